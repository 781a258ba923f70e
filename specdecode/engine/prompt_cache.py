"""A prompt cache in host memory: copies of finished requests' K/V, found again by token prefix.

The scheduler's slots keep their last request's context (engine/scheduler.py), but a slot
that takes a different prompt overwrites it. Before that happens the scheduler copies the
context's K/V here (`Model.snapshot`: a copy costs far less than computing the tokens
again), and a later prompt that starts the same way (a shared system prompt, a chat's earlier
turns, a retried request) is restored into its slot (`Model.restore`) instead of prefilled: only the rest of
the prompt is computed. llama.cpp's server keeps such a cache too (`--cache-ram`).

The cached values are the target's own K/V for those tokens, so decoding after a restore is
decoding after a prefill of them (up to the backend's usual rounding, which on llama.cpp
depends on where cells lie in the cache, as with batching). Memory is bounded: least recently
used entries go first, and an entry that alone exceeds the bound is not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from specdecode.backends.protocol import Snapshot, common_prefix


@dataclass(frozen=True, slots=True)
class Entry:
    ids: tuple[int, ...]  # the tokens whose K/V the snapshot holds, in cache order
    snapshot: Snapshot


class PromptCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prompt cache size must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, ids: Sequence[int], snapshot: Snapshot) -> None:
        """Keep `snapshot` (the K/V of `ids`). An entry whose tokens begin the new one's is dropped
        (the new one serves every prompt it served); if an entry already begins with these tokens,
        nothing is added."""
        ids = tuple(ids)
        if not ids or snapshot.nbytes > self.max_bytes:
            return
        if snapshot.length != len(ids):
            raise ValueError(f"a snapshot of {snapshot.length} positions cannot hold {len(ids)} tokens")
        for key in list(self._entries):
            if key[:len(ids)] == ids:  # already covered
                self._entries.move_to_end(key)
                return
            if ids[:len(key)] == key:  # superseded
                self._drop(key)
        self._entries[ids] = Entry(ids, snapshot)
        self.bytes += snapshot.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def best(self, ids: Sequence[int]) -> tuple[int, Entry | None]:
        """The entry sharing the longest start with `ids`, and how many tokens it shares (0, None: none)."""
        n, found = 0, None
        for entry in self._entries.values():
            m = common_prefix(entry.ids, ids)
            if m > n:
                n, found = m, entry
        if found is not None:
            self._entries.move_to_end(found.ids)
        return n, found

    def _drop(self, key: tuple[int, ...]) -> None:
        self.bytes -= self._entries.pop(key).snapshot.nbytes
