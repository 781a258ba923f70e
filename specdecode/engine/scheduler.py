"""Which requests run in a round, and in which slot: admission, chunked prefill, the prefix caches.

The scheduler holds the free slots and the requests in them. A request that arrives takes the free
slot that holds the longest start of its prompt (that much prefill is skipped), or waits for one.
Each round, every decoding request has a row in the pass, and the waiting prompts get a piece of
it (as llama.cpp's server does: the running rows advance while a prompt is processed, instead of
waiting for a pass of its own). Chunked prefill: a pass holds at most `prefill_tokens` tokens of
prompts (less the running rows' one token each), so a long prompt is computed over several rounds
and never stalls the running streams for more than one such pass; a prompt's last piece, when it
fits beside it, runs in the request's own row with the step that yields its first token (else the
request decodes from the next round). The shortest remaining prompt goes first (a short question
does not wait behind a long file, as it would in admission order: the mean time to first token is
least that way), and a prompt passed over for `patience` rounds goes before every other, so a long
one is never starved by a stream of short ones.

A request that ends, or leaves (a client that left, even mid-prompt), frees its slot at once. The
slot keeps its request's context, for a later prompt that starts the same way; with a prompt cache
in host memory (`prompt_cache_bytes`, engine/prompt_cache.py) the context moves there instead (in
one shared KV pool, as llama.cpp's, idle cells slow every running row's attention), and is restored
into a slot when a later prompt starts with more of it than any slot holds.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from specdecode.backends.protocol import Row, common_prefix
from specdecode.checks import integer
from specdecode.engine.prompt_cache import PromptCache
from specdecode.engine.request import Request, State
from specdecode.engine.slot import Slot


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How an engine schedules its requests.

    prefill_tokens: the most prompt tokens a pass computes, running rows included (None: a prompt runs
    whole, in its first row). prompt_cache_bytes: the prompt cache's bound in host memory (0: none; the
    target must declare `snapshots`). patience: the rounds a waiting prompt may get no piece before it
    goes first. isolate: a round that fails ends only the requests at fault (the engine reruns a shared
    round's rows one by one to find them); else every request ends and the error is raised. persistent:
    free slots' contexts are kept for later requests even while the engine has none (a server's, which
    owns its models); else they are forgotten whenever the engine runs out of requests, so a library
    call's output never depends on an earlier call's, nor on whatever used the models in between."""

    prefill_tokens: int | None = None
    prompt_cache_bytes: int = 0
    patience: int = 4
    isolate: bool = False
    persistent: bool = False

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "patience"):
            value = getattr(self, name)
            if (value is not None or name == "patience") and (integer(value) is None or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if integer(self.prompt_cache_bytes) is None or self.prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be an integer >= 0, got {self.prompt_cache_bytes!r}")


class Scheduler:
    def __init__(self, slots: Sequence[Slot], config: SchedulerConfig = SchedulerConfig()) -> None:
        self.config = config
        self.order = {id(slot): i for i, slot in enumerate(slots)}
        self.free: list[Slot] = list(slots)
        self.waiting: deque[Request] = deque()  # WAITING, in arrival order
        self.running: list[Request] = []  # PREFILLING or DECODING, in admission order
        # what each free slot's target holds (its last request's context): a prefix for the next prompt
        self.held: dict[int, list[int]] = {}
        snapshots = bool(slots) and slots[0].target.snapshots
        self.prompt_cache = PromptCache(config.prompt_cache_bytes) if config.prompt_cache_bytes and snapshots \
            else None

    def can_admit(self) -> bool:
        """A free slot (a long prompt waits its turn in pieces, not at the door: `schedule`)."""
        return bool(self.free)

    def take_slot(self, prompt: Sequence[int]) -> Slot:
        """The free slot that holds the longest start of `prompt` (a repeated system prompt, the earlier
        turns of a chat: that much prefill is skipped), out of the free list; of equals, the one free the
        longest (the least recently used context goes first)."""
        slot = max(self.free, key=lambda s: common_prefix(self.held.get(id(s), ()), prompt[:-1]))
        self.free.remove(slot)
        return slot

    def recall(self, slot: Slot, prompt: Sequence[int]) -> list[int]:
        """Make `slot` hold the longest start of prompt[:-1] it or the prompt cache has; the tokens it
        then holds. With a prompt cache a free slot holds nothing (`release` moved its context there)."""
        if self.prompt_cache is None:
            return self.held.pop(id(slot), [])
        self.held.pop(id(slot), None)
        _, entry = self.prompt_cache.best(prompt[:-1])
        if entry is None:
            return []
        try:
            slot.target.restore(entry.snapshot)
        except RuntimeError:  # the backend found no room for it: compute the prompt instead (same output)
            slot.target.truncate(0)
            return []
        return list(entry.ids)

    def start(self, request: Request) -> None:
        """A request that took its slot runs from now: PREFILLING while its prompt's rest waits for the
        passes, else DECODING."""
        request.state = State.PREFILLING if request.unfed else State.DECODING
        self.running.append(request)

    def schedule(self) -> tuple[list[Request], list[tuple[Request, Row]]]:
        """This round's rows: every decoding request, and the waiting prompts' share of the pass:
        prefill_tokens tokens less one per decoding row (so that, drafting aside, the pass stays within
        the bound), at least one. Prompts passed over `patience` rounds first, the longest passed over
        first; then the shortest remaining first (module docstring). A prompt whose rest fits beside its
        first token's step decodes in this round (its row feeds its rest: `Request.unfed`); of a longer
        one a piece runs as a prefill row. Returns (decoding requests, pieces)."""
        batch = [r for r in self.running if r.state is State.DECODING]
        bound = math.inf if self.config.prefill_tokens is None else self.config.prefill_tokens
        room, pieces = max(1, bound - len(batch)), []
        patience = self.config.patience
        line = sorted((r for r in self.running if r.state is State.PREFILLING),  # stable: ties keep admission order
                      key=lambda r: (0, -r.passed_over) if r.passed_over >= patience else (1, len(r.unfed)))
        for r in line:
            if room <= 0:
                r.passed_over += 1
                continue
            if len(r.unfed) + 1 <= room:  # the rest and the first token's step, in one row
                r.state = State.DECODING
                batch.append(r)
                room -= len(r.unfed) + 1
                continue
            n = int(min(room, len(r.unfed)))
            r.passed_over = 0
            pieces.append((r, Row(r.slot.target, r.unfed[:n], 1)))
            r.unfed = r.unfed[n:]
            if not r.unfed:  # all of it ran: it decodes from the next round
                r.state = State.DECODING
            room -= n
        return batch, pieces

    def release(self, request: Request, failed: bool = False) -> None:
        """A request leaves (ended, or its client left): FINISHED, its slot free. The slot keeps the
        request's context (the cache holds context[:-1], or more after a round cut at EOS or the budget:
        only the context's cells are known; or the start of its prompt, when it leaves mid-prompt),
        unless its round failed: then the cache's contents are unknown."""
        if request.state is State.WAITING:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self._free(request.slot, None if failed else request.context)
        request.state = State.FINISHED

    def free_slot(self, slot: Slot) -> None:
        """A slot taken for a request that could not start: free again, its cache's contents unknown."""
        self._free(slot, None)

    def forget(self, slot: Slot | None = None) -> None:
        """Drop what `slot` (None: every slot, all free) is known to hold; the prompt cache's copies stay
        valid (they are copies). Forgotten whole, the slots go back to their order: a lone request then
        runs in the first, whatever ran before (kernels may round by where its cells lie)."""
        if slot is None:
            self.held.clear()
            self.free.sort(key=lambda s: self.order[id(s)])
        else:
            self.held.pop(id(slot), None)

    def _free(self, slot: Slot, context: list[int] | None) -> None:
        target = slot.target
        if context is None:
            self.held.pop(id(slot), None)
            target.truncate(0)
        else:
            kept = context[:min(target.length, len(context) - 1)]
            target.truncate(len(kept))
            if self.prompt_cache is not None and kept:
                # an idle context costs the running rows: in llama.cpp's one KV pool attention spans every
                # slot's cells. In host memory it costs them nothing, and comes back by `recall` for a
                # prompt that starts the same way.
                try:
                    self.prompt_cache.put(kept, target.snapshot())
                except (RuntimeError, MemoryError):  # not copied out: a later prompt computes it again
                    pass
                target.truncate(0)
                self.held.pop(id(slot), None)
            else:
                self.held[id(slot)] = kept
        for drafter in slot.drafters:
            drafter.reset()
        self.free.append(slot)
