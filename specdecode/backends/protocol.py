"""The model protocol: everything the engine asks of a language model.

A backend owns one sequence's KV cache. `forward` appends tokens at positions
length .. length+n-1 and returns next-token logits for the last `n_logits` of
them; `truncate` rolls the cache back (rejected drafts) and must be cheap;
`sibling()` gives another sequence over the same weights with its own cache (a batch's slots).

What a backend may do beyond that is declared on it, with a default here: a backend subclasses
`Model` and overrides what it supports, in one place.
- Batched passes: `forward_batch` runs rows of several sequences with one `batch_group` in one
  pass (llama.cpp: siblings share a context and a `llama_decode`); by default each row runs alone.
- Draft trees (`trees = True`): `forward_tree` runs a tree after the cache (each token sees the cache
  and its own ancestors only, at position length + depth), and `accept_path` then keeps the accepted
  root-to-node path and drops the rest of the tree. Without them a backend verifies chains only.
- A prompt cache (`snapshots = True`, engine/prompt_cache.py): `snapshot` copies the cache's K/V out,
  `restore` puts such a copy back (into this sequence or a sibling), so a prompt computed once need
  not be computed again. Without them only what the sequences still hold is reused.
- `signature`: what its speed depends on (the calibration file's key); by default its name.
- `logit_tolerance`: how far a near-tie of its logits may move with a pass's shape (kernels that
  round by shape, as llama.cpp's); None: they do not move.
- `context_setting`: the parameter that sets `max_length` where a user can (llama.cpp: "n_ctx"),
  named when a prompt does not fit; None: the model's own limit.
- `eos_ids`: the end-of-text ids the model's own configuration names (the tokenizer's are added).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Model(Protocol):
    name: str
    vocab_size: int  # logits width
    max_length: int  # context limit in tokens
    trees: bool = False  # forward_tree / accept_path
    snapshots: bool = False  # snapshot / restore
    logit_tolerance: float | None = None
    context_setting: str | None = None
    eos_ids: frozenset[int] = frozenset()
    length: int  # tokens currently held in the cache

    def forward(self, tokens: Sequence[int], n_logits: int = 1) -> torch.Tensor:
        """Run `tokens` after the cache; return logits [n_logits, vocab] for the last n_logits inputs."""

    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached positions."""

    def sibling(self) -> "Model":
        """Another sequence over the same weights, with its own empty cache."""

    @property
    def signature(self) -> str:
        return self.name

    @property
    def batch_group(self) -> object:
        """Models of one group run their rows in one `forward_batch` call (default: each its own)."""
        return self

    def forward_batch(self, rows: Sequence["Row"]) -> list[torch.Tensor]:
        """Rows of this model's batch group, in one pass where the backend can; each row's logits."""
        return [row.run_alone() for row in rows]

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """A tree after the cache (parents[j]: an earlier index or -1); logits for every token."""
        raise NotImplementedError(f"{self.name} verifies chains only (it declares no trees)")

    def accept_path(self, path: Sequence[int]) -> None:
        """After `forward_tree`: keep the root-to-node `path` (indices, root first), drop the rest."""
        raise NotImplementedError(f"{self.name} verifies chains only (it declares no trees)")

    def snapshot(self) -> "Snapshot":
        """A copy of the cache, to `restore` later into this sequence or a sibling."""
        raise NotImplementedError(f"{self.name} keeps no snapshots (it declares none)")

    def restore(self, snapshot: "Snapshot") -> None:
        """Replace the cache by a copy `snapshot()` made."""
        raise NotImplementedError(f"{self.name} keeps no snapshots (it declares none)")


class Snapshot(NamedTuple):
    """A copy of a sequence's cache (`snapshot`), to `restore` later into it or a sibling."""

    length: int  # cache positions it holds
    data: object  # the backend's own copy of the K/V
    nbytes: int


class Row(NamedTuple):
    """One sequence's part of a pass: `tokens` after its cache, logits for the last n_logits of them;
    with `parents` a tree (`forward_tree`: parents[j] is an earlier index or -1, logits for all)."""

    model: Model
    tokens: Sequence[int]
    n_logits: int
    parents: Sequence[int] | None = None

    def run_alone(self) -> torch.Tensor:
        if self.parents is not None:
            return self.model.forward_tree(self.tokens, self.parents)
        return self.model.forward(self.tokens, n_logits=self.n_logits)


def forward_batch(rows: Sequence[Row | tuple]) -> list[torch.Tensor]:
    """`forward` (or `forward_tree`) for several sequences: each row's logits, in order.

    Rows whose models share a `batch_group` (llama.cpp siblings: their context) go to one
    `forward_batch` call, one pass where the backend can."""
    rows = [Row(*row) for row in rows]
    out: list[torch.Tensor | None] = [None] * len(rows)
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(id(row.model.batch_group), []).append(i)
    for members in groups.values():
        for i, logits in zip(members, rows[members[0]].model.forward_batch([rows[i] for i in members])):
            out[i] = logits
    return out  # type: ignore[return-value]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share: the cache cells that a cache holding a can keep for b."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, one a prefix of the other, compared at C speed
        return n                    # (asked every round by a draft model that sat out)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
