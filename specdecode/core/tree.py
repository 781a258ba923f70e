"""Exact verification of a draft tree: several candidates per position, one target pass.

A tree of N drafted nodes hangs below `pending` (the root). Node j holds a token x_j, its
parent (an earlier node, or -1 for the root) and q_j: the law x_j was drawn from GIVEN its
earlier siblings (a sampled candidate drawn without replacement: q with the earlier siblings
removed and renormalised, `remove`; a deterministic candidate, e.g. a top-m or lookup token:
one-hot). A node's children are tried in the order they were drawn. The target scored the
whole tree in one pass: p_0 after the root, p_{j+1} after node j. From the root, with r = p:

    for each child c of the current node, in order:
        accept x_c  iff  u_c * q_c(x_c) < r(x_c)       -> emit x_c; go down to c; r = p after c
        else        r = max(0, r - q_c) / |max(0, r - q_c)|   (c's mass leaves the residual)
    no child accepted (or a leaf): emit y ~ r          (the residual after every child, or p: the bonus)

Each candidate test is one speculative-sampling step against the current residual, whose output
law is that residual (Leviathan et al.'s lemma); by induction over the siblings the token emitted
below a node has law p exactly (SpecInfer's multi-step speculative sampling; with candidates drawn
without replacement, the recursive rejection sampling of Jeon et al. 2024). The condition is on the
drafter: each candidate, when drawn, has law q_c given everything drawn before it. How many
candidates a node gets may depend on anything drawn earlier (even on earlier siblings): the rest
of the walk emits the residual's law whatever that number is.

Labelled deviations, as in `verify`: `u * q < r` (no division; q_c(x_c) = 0 is rejected outright),
the residual kept normalised in float64, an all-zero residual (p == q up to rounding, rejection of
probability 0) falls back to r, the final token sampled by inverse CDF at one uniform v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode.core.probs import sample_with_uniform


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each token of a tree given its parents (a token whose parent is -1 has depth 0); a
    backend's tree row includes the root, so there depth is the offset from the root's position."""
    depth: list[int] = []
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"tree token {j} has parent {parent}: parents must be earlier tokens or -1")
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return depth


@dataclass(frozen=True, slots=True)
class DraftTree:
    """N drafted nodes below the root. parents[j] < j (-1 = the root); q [N, V]: each node's law
    given its earlier siblings, or None when every node is deterministic (one-hot q)."""

    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a tree needs one parent per token, got {len(self.tokens)} tokens and "
                             f"{len(self.parents)} parents")
        if any(not -1 <= parent < j for j, parent in enumerate(self.parents)):
            raise ValueError("every node's parent must be an earlier node or -1 (the root)")
        if self.q is not None and self.q.shape[0] != len(self.tokens):
            raise ValueError(f"q must have one row per node ({len(self.tokens)}), got {tuple(self.q.shape)}")

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """The children of `node` (-1: the root), in the order they were drawn."""
        return [j for j, parent in enumerate(self.parents) if parent == node]

    def depths(self) -> list[int]:
        """Each node's depth (a child of the root has depth 1): its position is length + depth."""
        return [d + 1 for d in tree_depths(self.parents)]

    def main_chain(self) -> list[int]:
        """The first child of every level from the root: the drafter's chain (alternatives beside it)."""
        chain = self.children(-1)[:1]
        while chain and self.children(chain[-1]):
            chain.append(self.children(chain[-1])[0])
        return chain

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node` (empty for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    @staticmethod
    def chain(tokens: list[int], q: torch.Tensor | None = None) -> "DraftTree":
        """K drafts in a row: the tree with one child per node."""
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), q)


@dataclass(frozen=True, slots=True)
class TreeResult:
    """path: the accepted nodes, root's child first; tokens: their tokens, then the residual/bonus token."""

    path: list[int]
    tokens: list[int]


def remove(dist: torch.Tensor, token: int) -> torch.Tensor:
    """`dist` with `token` removed and the rest renormalised: the law of the next draw without
    replacement, and the residual after a deterministic candidate is rejected (max(0, r - one-hot)).
    All zero once nothing is left (the caller falls back)."""
    out = dist.clone()
    out[token] = 0
    total = out.sum()
    return out / total if total > 0 else out


def residual(r: torch.Tensor, q_c: torch.Tensor | None, x: int) -> torch.Tensor:
    """r after candidate x (drawn from q_c; None = one-hot) is rejected: max(0, r - q_c), normalised.
    An all-zero result (rejection had probability 0; rounding) keeps r."""
    if q_c is None:
        left = remove(r, x)  # one-hot q_c: r without x, and no V-sized q row
    else:
        left = (r - q_c.to(torch.float64)).clamp_min(0)
        total = left.sum()
        left = left / total if total > 0 else left
    return left if bool(left.sum() > 0) else r


def verify_tree(tree: DraftTree, p: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> TreeResult:
    """Walk the tree as the module docstring says. p [N+1, V] (p[0] after the root, p[j+1] after
    node j); u [N] uniforms in [0, 1), one per node (used only if the node is tested); v []: the
    uniform of the one final sample (inverse CDF). A deterministic node never builds a V-sized q row."""
    check_tree(tree, p, u, v)
    p64 = p.to(torch.float64)
    node, r, path = -1, p64[0], []
    while True:
        for c in tree.children(node):
            x = tree.tokens[c]
            q_x = 1.0 if tree.q is None else float(tree.q[c, x])
            if q_x > 0 and float(u[c]) * q_x < float(r[x]):
                path.append(c)
                node, r = c, p64[c + 1]
                break
            r = residual(r, None if tree.q is None else tree.q[c], x)
        else:
            return TreeResult(path, [tree.tokens[j] for j in path] + [int(sample_with_uniform(r, v))])


def verify_tree_reference(tree: DraftTree, p: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> list[int]:
    """The walk written densely (every q a V-sized row, one-hot ones materialised): the oracle
    `verify_tree` must match bit for bit. Returns the emitted tokens."""
    p64 = p.to(torch.float64)
    V = p.shape[-1]

    def q_row(j: int) -> torch.Tensor:
        if tree.q is not None:
            return tree.q[j].to(torch.float64)
        return torch.zeros(V, dtype=torch.float64, device=p.device).index_fill_(
            0, torch.tensor([tree.tokens[j]], device=p.device), 1.0)

    emitted, node, r = [], -1, p64[0]
    while True:
        accepted = None
        for c in [j for j in range(len(tree)) if tree.parents[j] == node]:
            x, q_c = tree.tokens[c], q_row(c)
            if q_c[x] > 0 and float(u[c]) * float(q_c[x]) < float(r[x]):
                accepted = c
                break
            left = (r - q_c).clamp_min(0)
            if left.sum() > 0:
                r = left / left.sum()
        if accepted is None:
            return emitted + [int(sample_with_uniform(r, v))]
        emitted.append(tree.tokens[accepted])
        node, r = accepted, p64[accepted + 1]


def check_tree(tree: DraftTree, p: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> None:
    N = len(tree)
    if p.dim() != 2 or p.shape[0] != N + 1:
        raise ValueError(f"p must be [N+1, V] = [{N + 1}, V] for a tree of {N} nodes, got {tuple(p.shape)}")
    V = p.shape[1]
    if tree.q is not None and tuple(tree.q.shape) != (N, V):
        raise ValueError(f"the tree's q must be [N, V] = [{N}, {V}], got {tuple(tree.q.shape)}")
    if tuple(u.shape) != (N,) or tuple(v.shape) != ():
        raise ValueError(f"randomness must be u [{N}] and a scalar v, got {tuple(u.shape)} and {tuple(v.shape)}")
    if any(not 0 <= x < V for x in tree.tokens):
        raise ValueError(f"tree tokens must be token ids in [0, {V})")
