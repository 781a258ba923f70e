"""A toy context-dependent language model over a tiny vocabulary, for exactness tests.

probs(ctx) is a fixed random distribution for every context tuple (generated
lazily from a seed, so the same ToyModel always gives the same tables).
"""

from __future__ import annotations

import itertools

import torch

from specdecode.core.probs import SamplingParams, logits_to_probs


class ToyModel:
    def __init__(self, vocab: int, seed: int, sharpness: float = 2.0, zeros: bool = False,
                 params: SamplingParams = SamplingParams()) -> None:
        self.vocab, self.seed, self.sharpness, self.zeros, self.params = vocab, seed, sharpness, zeros, params
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed,) + ctx) % (2 ** 62))
        logits = torch.randn(self.vocab, generator=g, dtype=torch.float64) * self.sharpness
        if self.zeros:  # knock out some tokens entirely (never the argmax)
            mask = torch.rand(self.vocab, generator=g, dtype=torch.float64) < 0.3
            mask[logits.argmax()] = False
            logits[mask] = float("-inf")
        return logits

    def probs(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self._cache:
            self._cache[ctx] = logits_to_probs(self.logits(ctx), self.params)
        return self._cache[ctx]

    def joint(self, length: int) -> dict[tuple[int, ...], float]:
        """Exact probability of every token sequence of `length`."""
        out = {}
        for seq in itertools.product(range(self.vocab), repeat=length):
            prob = 1.0
            for i, tok in enumerate(seq):
                prob *= float(self.probs(seq[:i])[tok])
            out[seq] = prob
        return out
