"""Reproducible sampling: the token at every position is a function of (seed, position, p) alone.

The exponential race (Gumbel-max): argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d. is an exact
sample of p. Here the noise E of position t is drawn from a generator seeded by
mix(seed, t), a counter-based stream: a position's noise does not depend on how many
draws came before it, on K, on the drafter or on the batch. So

    y_t = argmax_v p_t(v) / E_{seed,t}(v)

is fixed by the seed and the prefix, and it is an exact sample of p_t given the prefix
(the noise of position t is independent of the noises that chose the prefix).

A draft that samples with the same noise, x_t = argmax_v q_t(v) / E_{seed,t}(v), proposes
the target's own choice whenever the two races agree, and verification is equality:
accept x_t iff x_t == y_t; at the first mismatch emit y_t, after K matches the bonus
y_{K+1}. The output is then token for token what plain decoding with the same seed gives.
The price is acceptance: the races agree with probability at most 1 - TV(p, q), the rate of
the rejection rule (docs/measurements-epyc.md: 2-4% fewer tokens a round).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.core.probs import argmax, exponential_noise, sample, sample_with_noise
from specdecode.core.tree import DraftTree

_MASK = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for one position: splitmix64 of the pair (distinct pairs, unrelated streams)."""
    z = ((seed & _MASK) * 0x9E3779B97F4A7C15 + (position & _MASK) + 0x632BE59BD9B4E5D) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True, slots=True)
class CounterNoise:
    """The noise of reproducible sampling: Exp(1) per (position, token), from the seed alone."""

    seed: int

    def noise(self, position: int, vocab: int) -> torch.Tensor:
        return exponential_noise((vocab,), torch.Generator().manual_seed(position_seed(self.seed, position)))

    def sample(self, p: torch.Tensor, position: int) -> int:
        """The token at `position` (0-based index in the whole sequence) given its distribution p [V]."""
        return int(sample_with_noise(p, self.noise(position, p.shape[-1]).to(p.device)))


def verify_equal(draft_tokens: list[int], p: torch.Tensor, noise: CounterNoise, first: int,
                 greedy: bool = False) -> tuple[int, list[int]]:
    """Reproducible verification of drafts at positions first, first+1, ...: p [K+1, V].

    Returns (n accepted, emitted tokens x_1..x_n, y): each draft is accepted iff it is the
    target's own choice at its position; y is the target's choice where the first draft
    failed, or the bonus after all K."""
    for i, x in enumerate(draft_tokens):
        y = sample_token(p[i], noise, first + i, greedy)
        if x != y:
            return i, list(draft_tokens[:i]) + [y]
    k = len(draft_tokens)
    return k, list(draft_tokens) + [sample_token(p[k], noise, first + k, greedy)]


def verify_tree_equal(tree: "DraftTree", p: torch.Tensor, noise: CounterNoise, first: int,
                      greedy: bool = False) -> tuple[list[int], list[int]]:
    """Reproducible verification of a draft tree (core/tree.py; p [N+1, V], root first): from the
    root, the target's own choice at each depth is accepted iff some child drafted it. Returns the
    accepted path (node indices) and the emitted tokens: the path's, then the choice below it."""
    node, path = -1, []
    while True:
        y = sample_token(p[node + 1], noise, first + len(path), greedy)
        match = [c for c in tree.children(node) if tree.tokens[c] == y]
        if not match:
            return path, [tree.tokens[j] for j in path] + [y]
        node = match[0]
        path.append(node)


def sample_token(p: torch.Tensor, source: "torch.Generator | CounterNoise", position: int, greedy: bool) -> int:
    """One token from p [V]: the argmax when greedy (p is one-hot), else from `source`: a random
    generator's draw, or reproducible sampling's choice at `position`."""
    if greedy:
        return int(argmax(p))
    if isinstance(source, CounterNoise):
        return source.sample(p, position)
    return int(sample(p, source))
