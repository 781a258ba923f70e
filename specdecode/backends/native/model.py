"""One sequence of a native model (weights.py): the engine's `Model` protocol.

The cache is ours (csrc/model.h): rolling back is moving an integer, a tree pass writes its nodes
after the cache and `accept_path` moves the accepted ones into place, and `snapshot`/`restore`
copy the K/V out and back. Siblings share the weights and run together in one pass.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np
import torch

from specdecode.backends.native import library as lib_
from specdecode.backends.native.weights import NativeWeights
from specdecode.backends.protocol import Model, Row, Snapshot
from specdecode.checks import SettingError, integer
from specdecode.core.tree import tree_depths


class NativeModel(Model):
    """A sequence (its own KV cache) over `weights`; `sibling()` gives more over the same weights."""

    trees = True  # the tree's nodes after the cache, the accepted path moved into place (sd_seq_keep)
    snapshots = True  # the K/V copied out and back (sd_seq_state_get / set)
    context_setting = "n_ctx"  # the parameter named when a prompt does not fit
    # logits depend only on the context, never on the pass around it (weights.py): a K-token pass,
    # K one-token passes and any batch agree exactly, so only exact ties may go either way
    logit_tolerance = 0.0

    def __init__(self, weights: NativeWeights, name: str | None = None) -> None:
        self.weights = weights
        self.lib = weights.lib
        self.name = name or weights.name
        self.vocab_size = weights.n_vocab
        self.max_length = weights.max_length
        self.device = torch.device("cpu")
        self.seq = weights.new_sequence()
        weakref.finalize(self, weights.lib.sd_seq_free, self.seq)
        self._tree: tuple[int, list[int]] | None = None  # (base, parents) of a tree pass awaiting accept_path

    @property
    def length(self) -> int:
        return int(self.lib.sd_seq_length(self.seq))

    @property
    def signature(self) -> str:
        """What this model's speed depends on (the calibration cache's key)."""
        w = self.weights
        return (f"native {w.name} ({w.nbytes} B) kernel={w.kernel} threads={w.settings.threads()} "
                f"head={w.head_tokens}")

    @property
    def batch_group(self) -> NativeWeights:
        """Siblings (one weights) run their rows in one pass."""
        return self.weights

    def forward(self, tokens: Sequence[int], n_logits: int = 1) -> torch.Tensor:
        return forward_rows([Row(self, tokens, n_logits)])[0]

    def forward_batch(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        return forward_rows(rows)

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """A draft tree after the cache, in one pass; logits for every token. The root (tokens[0])
        joins the cache; the rest waits for `accept_path`."""
        return forward_rows([Row(self, tokens, len(tokens), parents)])[0]

    def accept_path(self, path: Sequence[int]) -> None:
        """After `forward_tree`: keep the root and the tree tokens `path` (indices, root first, each
        the parent of the next) as this sequence's next cache positions; drop the rest of the tree."""
        if self._tree is None:
            raise ValueError("accept_path() without a tree pass before it")
        base, parents = self._tree
        if not path or path[0] != 0 or any(parents[b] != a for a, b in zip(path, path[1:])):
            raise ValueError(f"{list(path)} is not a root-to-node path of the tree")
        self._tree = None
        src = np.array([base + j for j in path[1:]], dtype=np.int64)
        if src.size:
            lib_.check(self.lib.sd_seq_keep(self.weights.ptr, self.seq, src.ctypes.data, src.size),
                       f"{self.name}: keeping the accepted path")

    def truncate(self, length: int) -> None:
        self._tree = None
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        lib_.check(self.lib.sd_seq_truncate(self.seq, length), f"{self.name}: truncate")

    def snapshot(self) -> Snapshot:
        """A copy of this sequence's cache (see `backends.protocol`)."""
        self._tree = None
        size = int(self.lib.sd_seq_state_bytes(self.weights.ptr, self.seq))
        data = np.empty(size, dtype=np.uint8)
        lib_.check(self.lib.sd_seq_state_get(self.weights.ptr, self.seq, data.ctypes.data), f"{self.name}: snapshot")
        return Snapshot(self.length, (self.weights, data), size)

    def restore(self, snapshot: Snapshot) -> None:
        """Replace this sequence's cache by a copy `snapshot()` made (of it or a sibling)."""
        owner, data = snapshot.data if isinstance(snapshot, Snapshot) and isinstance(snapshot.data, tuple) \
            else (None, None)
        if owner is not self.weights or not isinstance(data, np.ndarray) or data.dtype != np.uint8 \
                or not 0 <= snapshot.length <= self.max_length:
            raise ValueError(f"{self.name}: not a snapshot of this model's sequences")
        self._tree = None
        data = np.ascontiguousarray(data)
        lib_.check(self.lib.sd_seq_state_set(self.weights.ptr, self.seq, data.ctypes.data, data.size,
                                             snapshot.length), f"{self.name}: restore")

    def sibling(self) -> "NativeModel":
        """Another sequence over the same weights, with its own empty cache."""
        return NativeModel(self.weights, self.name)


def forward_rows(rows: Sequence[Row]) -> list[torch.Tensor]:
    """Rows of sequences of one NativeWeights in one pass (in pieces of n_batch tokens when longer):
    each row's logits [n_logits, vocab] for its last n_logits tokens (every token of a tree row)."""
    rows = [Row(*row) for row in rows]
    if not rows:
        return []
    weights = rows[0].model.weights
    for model, tokens, n_logits, parents in rows:
        n = len(tokens)
        if not isinstance(model, NativeModel) or model.weights is not weights:
            raise ValueError("a pass runs the sequences of one load of the weights (a model and its siblings); "
                             f"{getattr(model, 'name', model)!r} is not one of them")
        if n == 0 or not 1 <= n_logits <= n:
            raise ValueError(f"forward needs >= 1 token and 1 <= n_logits <= {n}, got {n} tokens, n_logits={n_logits}")
        if parents is not None:
            if len(parents) != n or parents[0] != -1 or any(not 0 <= p < j for j, p in enumerate(parents) if j):
                raise ValueError("a tree row has one root, its first token (parents[0] = -1), and every other "
                                 "parent is an earlier token")
            if n > weights.settings.n_batch:
                raise ValueError(f"a tree of {n} tokens exceeds n_batch={weights.settings.n_batch}")
        if model.length + n > model.max_length:
            raise SettingError(f"{model.name}: {model.length + n} tokens exceed the context of "
                               f"{model.max_length} (raise {{n_ctx}})")
        for t in tokens:
            if integer(t) is None or not 0 <= t < weights.n_vocab:
                raise ValueError(f"token id {t!r} is not an integer in the vocabulary [0, {weights.n_vocab})")
    if len({id(row.model) for row in rows}) != len(rows):
        raise ValueError("a pass holds each sequence at most once")
    for row in rows:
        row.model._tree = None
    # pieces of at most n_batch tokens per pass; each piece returns the logits it holds of the row's last n_logits
    limit = weights.settings.n_batch
    parts: list[list[torch.Tensor]] = [[] for _ in rows]
    pending = [(r, 0) for r in range(len(rows))]  # (row, first token not yet run)
    while pending:
        batch, budget, rest = [], limit, []
        for r, start in pending:
            row = rows[r]
            take = min(len(row.tokens) - start, budget)
            if take <= 0 or (row.parents is not None and take < len(row.tokens)):
                rest.append((r, start))  # no room left in this pass (a tree never goes in pieces)
                continue
            batch.append((r, start, take))
            budget -= take
        wanted = [max(0, start + take - max(start, len(rows[r].tokens) - rows[r].n_logits)) for r, start, take in batch]
        logits = weights.forward_rows([rows[r].model.seq for r, _, _ in batch],
                                      [rows[r].tokens[start:start + take] for r, start, take in batch],
                                      wanted, [rows[r].parents for r, _, _ in batch])
        for (r, start, take), lg in zip(batch, logits):
            if lg.shape[0]:
                parts[r].append(lg)
            if start + take < len(rows[r].tokens):
                rest.append((r, start + take))
            elif rows[r].parents is not None:
                rows[r].model._tree = (rows[r].model.length - 1, list(rows[r].parents))
        pending = rest
    return [p[0] if len(p) == 1 else torch.cat(p) for p in parts]
