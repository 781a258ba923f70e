"""The rules applied to a round's rows: each row's logits into its accepted drafts and next token.

- a plain row (nothing drafted) takes one token from p_1 (`plain_token`);
- chains go to their rule together: the rows of one rule in ONE call, ragged (`lengths`), each row
  with the randomness drawn from its own generator, so what a row emits never depends on the rows
  beside it (`verify_chains`);
- a tree takes its rule's multi-candidate walk (`verify_tree_row`);
- reproducible rows (a `CounterNoise` for randomness) are verified by equality with the target's
  own choice at each position (core/reproducible.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.core.probs import SamplingParams, greedy_token, logits_to_probs
from specdecode.core.reproducible import CounterNoise, sample_token, verify_tree_equal
from specdecode.core.tree import DraftTree
from specdecode.core.verify import Randomness


def plain_token(logits: torch.Tensor, params: SamplingParams, source: "torch.Generator | CounterNoise",
                position: int) -> tuple[int, torch.Tensor | None]:
    """A plain step's token from p_1's logits [V], and p_1 (None when greedy: it would be one-hot at
    the token, and building it costs a V-sized row per token)."""
    if params.greedy:
        return greedy_token(logits), None
    p = logits_to_probs(logits, params)
    return sample_token(p, source, position, False), p


def verify_chains(rule, drafts: Sequence[list[int]], q: Sequence[torch.Tensor | None], p: Sequence[torch.Tensor],
                  rand: Sequence[Randomness]) -> list[tuple[int, list[int]]]:
    """(drafts accepted, tokens emitted) of each chain row, all judged by `rule` in one call.

    Row b drafted drafts[b] from q[b] ([k_b, V], None: one-hot) and has p[b] ([k_b + 1, V]) and
    rand[b] (drawn from its own generator). Rows of different K are padded to the longest (a padded
    position is never tested: `lengths`), a one-hot q is written out where another row has a q, and
    every tensor goes to p's device (q comes from the draft model's, the randomness from the
    generator's: a seed's output depends neither on the device nor on the other rows)."""
    device, dtype = p[0].device, p[0].dtype
    k = max(len(d) for d in drafts)
    tokens = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long, device=device)
    if all(row is None for row in q):
        q_all = None
    else:
        q_all = _stack([_one_hot(d, p_b) if q_b is None else q_b.to(device=device, dtype=dtype)
                        for d, q_b, p_b in zip(drafts, q, p)], k)
    u = torch.ones((len(drafts), k), dtype=torch.float64, device=device)
    for b, r in enumerate(rand):
        u[b, :r.u.shape[1]] = r.u[0]
    args = (tokens, q_all, _stack(list(p), k + 1), Randomness(u, torch.cat([r.v for r in rand])))
    if any(len(d) != k for d in drafts):  # `lengths` where the rows' K differ (its default: K everywhere)
        result = rule(*args, torch.tensor([len(d) for d in drafts], device=device))
    else:
        result = rule(*args)
    return [(int(result.n_accepted[b]), result.emitted(b)) for b in range(len(drafts))]


def verify_tree_row(rule, tree: DraftTree, p: torch.Tensor, source: "torch.Generator | CounterNoise",
                    position: int, greedy: bool) -> tuple[list[int], list[int]]:
    """A tree row: (the accepted path's node indices, the emitted tokens), by the multi-candidate walk
    of the chain rule's `tree_rule` (block verification is a chain rule; the audit's broken controls
    name broken tree rules), or by equality in reproducible mode."""
    if isinstance(source, CounterNoise):
        return verify_tree_equal(tree, p, source, position, greedy)
    rand = Randomness.draw(1, len(tree), source, device=p.device)
    tree = DraftTree(tree.tokens, tree.parents, None if tree.q is None else tree.q.to(p.device))
    result = rule.tree_rule(tree, p, rand.u[0], rand.v[0])
    return result.path, result.tokens


def _stack(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Rows [n_b, V] as one [B, length, V] tensor, zero past each row's own n_b (one row: a view)."""
    if len(rows) == 1 and rows[0].shape[0] == length:
        return rows[0][None]
    out = rows[0].new_zeros((len(rows), length, rows[0].shape[-1]))
    for b, row in enumerate(rows):
        out[b, :row.shape[0]] = row
    return out


def _one_hot(drafts: list[int], p: torch.Tensor) -> torch.Tensor:
    """The q of deterministic drafts, written out: [k, V], one at each draft."""
    return torch.zeros((len(drafts), p.shape[-1]), dtype=p.dtype, device=p.device).scatter_(
        1, torch.tensor(drafts, device=p.device)[:, None], 1.0)
