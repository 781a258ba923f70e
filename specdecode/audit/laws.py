"""Exact laws from the target, and samples from the engine, both from one prefix.

The prefix is prefilled once; every sample restores the target cache to it
(truncate) and runs real engine rounds (`engine.round.run_round`), so thousands of
samples cost only their own rounds. In the batched mode every round of the audited
sequence shares its target pass with neighbour sequences (other slots, their own
prefixes, drafts and randomness), as requests do in the server. The draft model's cache follows by itself:
it keeps the longest common prefix with each new context.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from specdecode.backends.protocol import Model
from specdecode.core.probs import SamplingParams, logits_to_probs
from specdecode.core.verify import verify
from specdecode.drafters.protocol import Drafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.policy import FixedK, KPolicy
from specdecode.engine.request import Request, State, VerifyRule
from specdecode.engine.round import run_round
from specdecode.engine.slot import Slot, prefill

UNBOUNDED = 1 << 30  # no token budget inside a round: the audit wants full K rounds


def sample_first_tokens(target: Model, drafters: Sequence[Drafter], policy: KPolicy, prefix: Sequence[int],
                        params: SamplingParams, n_samples: int, n_tokens: int, generator: torch.Generator,
                        rule: VerifyRule = verify, tick: Callable[[], None] | None = None,
                        neighbours: Sequence[tuple[Slot, Sequence[int]]] = ()) -> list[tuple[int, ...]]:
    """n_samples independent draws of the first n_tokens the engine emits after `prefix`.

    neighbours: (slot, prefix) of sequences that run beside it in every round's pass (K = 2,
    their own generator), each restored to its prefix with every sample."""
    if not prefix:
        raise ValueError("the audit prompt is empty")
    base = prefill(target, drafters, prefix)
    bases = [prefill(slot.target, slot.drafters, pre) for slot, pre in neighbours]
    # the neighbours' randomness: their own generator, seeded from the audit's (only when batched)
    others = torch.Generator().manual_seed(int(torch.randint(1 << 62, (1,), generator=generator))) \
        if neighbours else None
    policy.begin()
    config = GenerationConfig(max_new_tokens=UNBOUNDED, sampling=params)
    audited = Slot(target, tuple(drafters))
    out = []
    for _ in range(n_samples):
        rows = [_decoding(audited, prefix, config, policy, rule, generator)] + [
            _decoding(slot, pre, config, FixedK(2), verify, others) for slot, pre in neighbours]
        while len(rows[0].tokens) < n_tokens:
            run_round(rows)  # the policies learn from every round, as a request's do
        out.append(tuple(rows[0].tokens[:n_tokens]))
        target.truncate(base)
        for (slot, _), b in zip(neighbours, bases):
            slot.target.truncate(b)
        if tick:
            tick()
    return out


def _decoding(slot: Slot, prefix: Sequence[int], config: GenerationConfig, policy: KPolicy, rule: VerifyRule,
              generator: torch.Generator) -> Request:
    """A request decoding after `prefix`, whose slot's target holds prefix[:-1] (no EOS, no budget)."""
    return Request(None, list(prefix), config, policy, rule, generator, frozenset(), slot=slot, state=State.DECODING)


def next_logits(target: Model, prefix: Sequence[int]) -> torch.Tensor:
    """The target's next-token logits after `prefix` (a fresh prefill, then `pending` alone: the
    engine's first round feeds both in one pass, which computes the same logits)."""
    base = prefill(target, [], prefix)
    logits = target.forward([prefix[-1]], 1)[0]
    target.truncate(base)
    return logits


def next_token_law(target: Model, prefix: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """p(. | prefix) after the same processing the engine applies."""
    return logits_to_probs(next_logits(target, prefix), params).double()


def two_token_law(target: Model, prefix: Sequence[int], params: SamplingParams, mass: float = 0.99,
                  max_branch: int = 24) -> tuple[dict[tuple[int, int], float], float]:
    """p(y1) p(y2 | y1) over the likeliest continuations; returns (cells, probability of the rest).

    y1 ranges over the smallest top set covering `mass` (at most max_branch tokens), and
    for each y1 so does y2; everything else is one merged "rest" cell.
    """
    p1 = next_token_law(target, prefix, params)
    base = target.length  # next_logits left the prefix (minus its last token) in the cache
    cells: dict[tuple[int, int], float] = {}
    for y1 in _top_set(p1, mass, max_branch):
        p2 = logits_to_probs(target.forward([prefix[-1], y1], 1)[0], params).double()
        target.truncate(base)
        for y2 in _top_set(p2, mass, max_branch):
            cells[(y1, y2)] = float(p1[y1] * p2[y2])
    return cells, max(0.0, 1.0 - sum(cells.values()))


def _top_set(p: torch.Tensor, mass: float, limit: int) -> list[int]:
    probs, ids = torch.sort(p, descending=True)
    n = int((torch.cumsum(probs, 0) < mass).sum()) + 1
    return [int(i) for i, pr in zip(ids[: min(n, limit)], probs[: min(n, limit)]) if pr > 0]
