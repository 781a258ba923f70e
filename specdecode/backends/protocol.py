"""The model protocol: everything the engine asks of a language model.

A backend owns one sequence's KV cache. `forward` appends tokens at positions
length .. length+n-1 and returns next-token logits for the last `n_logits` of
them; `truncate` rolls the cache back (rejected drafts) and must be cheap.

Several sequences at once (batching): `sibling()` gives another sequence over the
same weights with its own cache; `forward_batch` runs one round's rows of several
sequences, in one pass where the backend can (llama.cpp: siblings share a context
and a `llama_decode`), else one pass per row (transformers: docs/guide.md, "Max batch").

A prompt cache (engine/prompt_cache.py): `snapshot` copies the cache's K/V out, `restore` puts such
a copy back (into this sequence or a sibling), so a prompt computed once need not be computed again.
A backend without them keeps only what its sequences still hold.

Draft trees: `forward_tree` runs a tree after the cache (each token sees the cache and its own
ancestors only, at position length + depth), and `accept_path` then keeps the accepted root-to-node
path and drops the rest of the tree. A backend without them verifies chains only.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Model(Protocol):
    name: str
    vocab_size: int  # logits width
    max_length: int  # context limit in tokens
    # Optional: `context_setting`, the option that sets max_length where a user can (llama.cpp:
    # "n_ctx (--n-ctx)"), named when a prompt does not fit; absent: the model's own limit.

    @property
    def length(self) -> int:
        """Tokens currently held in the cache."""

    def forward(self, tokens: Sequence[int], n_logits: int = 1) -> torch.Tensor:
        """Run `tokens` after the cache; return logits [n_logits, vocab] for the last n_logits inputs."""

    def truncate(self, length: int) -> None:
        """Keep only the first `length` cached positions."""

    def sibling(self) -> "Model":
        """Another sequence over the same weights, with its own empty cache."""


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
            return self.model.forward_tree(self.tokens, self.parents)  # type: ignore[attr-defined]
        return self.model.forward(self.tokens, n_logits=self.n_logits)


def forward_batch(rows: Sequence[Row | tuple]) -> list[torch.Tensor]:
    """`forward` (or `forward_tree`) for several sequences: each row's logits, in order.

    Rows whose models share a batched pass (a `forward_batch` method, as llama.cpp siblings
    have) run together, one pass per such group; any other row runs alone."""
    rows = [Row(*row) for row in rows]
    out: list[torch.Tensor | None] = [None] * len(rows)
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        model = row.model
        key = id(getattr(model, "context", model)) if hasattr(model, "forward_batch") else -1 - i
        groups.setdefault(key, []).append(i)
    for members in groups.values():
        model = rows[members[0]].model
        if hasattr(model, "forward_batch"):
            for i, logits in zip(members, model.forward_batch([rows[i] for i in members])):
                out[i] = logits
        else:
            out[members[0]] = rows[members[0]].run_alone()
    return out  # type: ignore[return-value]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share: the cache cells that a cache holding a can keep for b."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # the usual case, one a prefix of the other, compared at C speed
        return n                    # (asked every round by a draft model that sat out: 0.07 ms for 2,000)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
