"""Deliberately broken verification rules: negative controls the audit must flag.

Each reproduces a bug class that shipped in real projects. They are never used
for generation; they exist so a user can see that the audit has statistical power.
"""

from __future__ import annotations

import torch

from specdecode.core.probs import sample_with_uniform
from specdecode.core.tree import DraftTree, TreeResult, verify_tree
from specdecode.core.verify import Randomness, VerifyResult, verify


def always_accept(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, rand: Randomness,
                  lengths: torch.Tensor | None = None) -> VerifyResult:
    """BROKEN: accepts every draft (the output follows q, not p), then a bonus token from p."""
    B, K = draft_tokens.shape
    bonus = sample_with_uniform(p[:, K], rand.v)
    return VerifyResult(torch.full((B,), K, dtype=torch.long), torch.cat([draft_tokens, bonus[:, None]], 1))


def residual_from_p(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, rand: Randomness,
                    lengths: torch.Tensor | None = None) -> VerifyResult:
    """BROKEN: after a rejection, resamples from p instead of the residual max(0, p - q)."""
    result = verify(draft_tokens, q, p, rand, lengths)
    rows = torch.arange(draft_tokens.shape[0])
    n = result.n_accepted
    rejected = n < draft_tokens.shape[1]
    tokens = result.tokens.clone()
    resampled = sample_with_uniform(p[rows, n], rand.v)
    tokens[rows, n] = torch.where(rejected, resampled, tokens[rows, n])
    return VerifyResult(n, tokens)


def tree_always_accept(tree: DraftTree, p: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> TreeResult:
    """BROKEN (trees): accepts the first child at every level (the drafter's chain), then a bonus from p."""
    path = tree.main_chain()
    last = path[-1] + 1 if path else 0
    return TreeResult(path, [tree.tokens[j] for j in path] + [int(sample_with_uniform(p[last], v))])


def tree_residual_from_p(tree: DraftTree, p: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> TreeResult:
    """BROKEN (trees): the walk, but after a rejected node the next token comes from p, not the residual
    (a rejected candidate's mass stays: the bug of accepting a sibling without removing it)."""
    result = verify_tree(tree, p, u, v)
    node = result.path[-1] if result.path else -1
    if not tree.children(node):  # a bonus: nothing was rejected below this node
        return result
    return TreeResult(result.path, result.tokens[:-1] + [int(sample_with_uniform(p[node + 1], v))])


# the loop verifies a tree row with its rule's `tree_rule` (the real rules: core.tree.verify_tree)
always_accept.tree_rule = tree_always_accept  # type: ignore[attr-defined]
residual_from_p.tree_rule = tree_residual_from_p  # type: ignore[attr-defined]

CONTROLS = {"always-accept": always_accept, "residual-from-p": residual_from_p}
