"""Continuous batching: requests join and leave a running batch between rounds.

The scheduler owns the decoder's slots. `admit` puts a request into a free slot and its
prompt in line to run; `step` runs one round of every running request in one target pass,
with the next piece of the waiting prompts in the same pass (as llama.cpp's server does: the
running rows advance while a prompt is processed, instead of waiting for a pass of its own),
and returns each one's new text. Chunked prefill: a pass holds at most `prefill_tokens`
tokens of prompts (less the running rows' one token each), so a long prompt is computed over
several rounds and never stalls the running streams for more than one such pass; a prompt's last
piece, when it fits beside it, runs in the request's own row with the step that yields its first
token (else the request decodes from the next round). The shortest remaining prompt goes
first (a short question does not wait behind a long file, as it would in admission order: the
mean time to first token is least that way), and a prompt passed over for `patience` rounds
goes before every other, so a long one is never starved by a stream of short ones.
A request that ends, or that the caller `release`s (a client that left, even mid-prompt),
frees its slot at once. With `isolate` (the server's), a request whose round fails (an exception, not
an interrupt) ends alone with its error (`Active.error`): a shared round that fails is rewound and its
rows run one at a time, so the request at fault is found and its neighbours go on as if it had never
been beside them. Without (the library's batch), the error is raised: a caller sees it at once.
With a prompt cache in host memory (`cache_bytes`, engine/prompt_cache.py) the freed slot's
context moves there (in one shared KV pool, as llama.cpp's, idle cells slow every running row's
attention), and is restored into a slot when a later prompt starts with more of it than any slot
holds. Without one, a freed slot
keeps its request's context (a prefix cache): `admit` picks the free slot holding the
longest start of the new prompt.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

import torch

from specdecode.backends.protocol import Row, common_prefix
from specdecode.checks import integer
from specdecode.engine.config import DEFAULT_PREFILL_TOKENS, GenerationConfig
from specdecode.engine.decoder import Chunk, Generation, SpeculativeDecoder, TextAssembler, check_stats
from specdecode.engine.loop import Round, start, step
from specdecode.engine.prompt_cache import PromptCache
from specdecode.engine.sequence import Sequence as Seq, Slot
from specdecode.engine.stats import GenerationStats


@dataclass(eq=False)
class Waiting:
    """An admitted prompt whose rest (its sequence's `unfed`) waits for room in a pass: the rounds in a
    row it got no piece of one."""

    passed_over: int = 0


@dataclass(eq=False)
class Active:
    """A running request: the caller's handle, its sequence and its text so far; `error`, what ended it
    if its round failed (it then left the batch, as a finished one does)."""

    key: Hashable
    seq: Seq
    text: TextAssembler
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class _Mark:
    """Where a row of a round stood before the round: its target's cache length and its generator's
    state (what `rewind` puts back when the shared round fails: `Scheduler._alone`)."""

    active: Active
    length: int
    generator: torch.Tensor | None  # a torch generator's state (None: CounterNoise, a function of position)

    @staticmethod
    def of(active: Active) -> "_Mark":
        source = active.seq.generator
        return _Mark(active, active.seq.slot.target.length,
                     source.get_state() if isinstance(source, torch.Generator) else None)

    def rewind(self) -> None:
        self.active.seq.slot.target.truncate(self.length)  # drops what the pass wrote, a tree's scratch too
        if self.generator is not None:
            self.active.seq.generator.set_state(self.generator)


class Scheduler:
    def __init__(self, decoder: SpeculativeDecoder, prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                 cache_bytes: int = 0, patience: int = 4, isolate: bool = False) -> None:
        """prefill_tokens: the most prompt tokens a pass computes, running rows included (module
        docstring). cache_bytes: the prompt cache's bound in host memory (0: none; the target's
        backend must have `snapshot`/`restore`, as llama.cpp and transformers do). patience: the
        rounds a waiting prompt may get no piece before it goes first. isolate: a failed round ends
        only the requests at fault (`_alone`); else `step` releases every request and raises."""
        for name, value in (("prefill_tokens", prefill_tokens), ("patience", patience)):
            if integer(value) is None or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.decoder, self.prefill_tokens, self.patience, self.isolate = decoder, prefill_tokens, patience, isolate
        self.isolated = 0  # shared rounds that failed and ran row by row (`_alone`): a count for /metrics
        self.prompt_cache = PromptCache(cache_bytes) if cache_bytes and decoder.target.snapshots else None
        self.free: list[Slot] = list(decoder.slots)
        # a prefix cache: the token ids whose K/V each free slot's target still holds (its last request's),
        # with that request's sequence (still the cache's owner unless something else used the target since)
        self.cached: dict[int, tuple[Seq, list[int]]] = {}
        self.running: list[Active] = []
        # admitted requests whose prompts have not all run, in admission order
        self._prompts: dict[Active, Waiting] = {}
        self.pass_tokens = 0  # tokens in the last round's pass, prompts' pieces included (0: no pass)
        self.pass_rows = 0  # sequences in the last round's pass: decoding rows and prompts' pieces

    def can_admit(self) -> bool:
        """A free slot (a long prompt waits its turn in pieces, not at the door: `step`)."""
        return bool(self.free)

    def admit(self, key: Hashable, ids: Sequence[int], config: GenerationConfig, speculative: bool = True,
              stats: GenerationStats | None = None) -> Active:
        """Put a request into a free slot: its prompt runs in the next rounds' passes (in pieces, shortest
        remaining first: `_prompt_pieces`), and it decodes from the round of its last piece (that piece
        in its own row) or, when the piece fills the room, from the round after. Raises
        ValueError for a request that cannot run (e.g. a prompt longer than the context), slot kept
        free."""
        if not self.free:
            raise RuntimeError("no free slot: check can_admit() first")
        # the free slot that holds the longest prefix of this prompt (a repeated system prompt, the
        # earlier turns of a chat): that much prefill is skipped
        slot = max(self.free, key=lambda s: common_prefix(self._cached(s), ids[:-1]))
        self.free.remove(slot)
        try:
            seq = self.decoder.sequence(slot, ids, config, stats if stats is not None else GenerationStats(),
                                        speculative)
            start(seq, self._recall(slot, ids[:-1]))
        except BaseException:
            self._free(slot)
            raise
        active = Active(key, seq, TextAssembler(self.decoder.tokenizer, config.stop, seq.stats))
        self.running.append(active)
        if seq.unfed:
            self._prompts[active] = Waiting()
        return active

    def step(self) -> list[tuple[Active, list[Chunk]]]:
        """One round of every running request; those that end leave the batch (their last text included).
        If the round fails: with `isolate`, the requests at fault leave it (their `error` set, no text:
        `_alone`); else, as on an interrupt (KeyboardInterrupt and the like, always), every running
        request is released and the error raised."""
        batch = [a for a in self.running if a not in self._prompts]
        pieces, joining = self._prompt_pieces(len(batch))
        batch += joining
        n_prompt = sum(len(row.tokens) for _, row in pieces) + sum(len(a.seq.unfed) for a in joining)
        marks = [_Mark.of(a) for a in [*batch, *(a for a, _ in pieces)]] if self.isolate else []
        t0 = time.perf_counter()
        try:
            rounds = step([a.seq for a in batch], [row for _, row in pieces])
        except Exception as exc:
            if self.isolate:
                return self._alone(batch, pieces, marks, exc)
            for a in list(self.running):
                self.release(a, failed=True)
            raise
        except BaseException:
            for a in list(self.running):
                self.release(a, failed=True)
            raise
        # the prompts' pieces' share of the pass, by tokens, is their prefill time (a prompt's rest in its own
        # row: `step` counts its share)
        t_pass = time.perf_counter() - t0
        self.pass_tokens = n_pass = n_prompt + sum(a.seq.stats.rounds[-1].verified for a in batch)
        self.pass_rows = len(batch) + len(pieces)
        for a, row in pieces:
            a.seq.stats.t_prefill += t_pass * len(row.tokens) / n_pass
        return [self._text(a, rnd) for a, rnd in zip(batch, rounds)]

    def _text(self, a: Active, rnd: Round) -> tuple[Active, list[Chunk]]:
        """A round's new text for its request (which leaves the batch if it ended, or if its text failed)."""
        try:
            chunks = [a.text.add(rnd)]
            if a.text.stopped:  # a stop string: the output ends here
                a.seq.finished = True
            elif a.seq.finished and (tail := a.text.finish()) is not None:
                chunks.append(tail)
        except Exception as exc:
            if not self.isolate:
                self.release(a, failed=True)
                raise
            return self._fail(a, exc)
        if a.seq.finished:
            self.release(a)
        return a, chunks

    def _alone(self, batch: list[Active], pieces: list[tuple[Active, Row]], marks: list[_Mark],
               exc: Exception) -> list[tuple[Active, list[Chunk]]]:
        """A round failed with `exc`. Alone in its pass, the request fails. Shared, the pass's rows are
        rewound (each target's cache and generator as before the round: `_Mark`) and each runs alone:
        the ones that fail alone end with their error, and the others get the round they would have had
        alone (from the same state: a seeded request's generator is put back; the drafters follow the
        unchanged context). A failure
        that only a shared pass meets (e.g. no room for all its rows in a KV pool) costs that round one
        pass per row, and the next round tries the shared pass again."""
        self.pass_tokens = self.pass_rows = 0  # no shared pass ran
        if len(marks) == 1:
            return [self._fail(marks[0].active, exc)]
        self.isolated += 1
        try:
            for mark in marks:
                mark.rewind()
        except Exception:  # the caches' contents are unknown: every request of the round fails
            return [self._fail(mark.active, exc) for mark in marks]
        out = []
        for a, row in pieces:  # a prompt's piece (its tokens already taken from `unfed`)
            try:
                step([], [row])
            except Exception as own:
                out.append(self._fail(a, own))
        for a in batch:
            try:
                rnd = step([a.seq])[0]
            except Exception as own:
                out.append(self._fail(a, own))
                continue
            out.append(self._text(a, rnd))
        return out

    def _fail(self, a: Active, exc: Exception) -> tuple[Active, list[Chunk]]:
        """End a request with its error: it leaves the batch, its slot's cache dropped."""
        a.error = exc
        self.release(a, failed=True)
        return a, []

    def _prompt_pieces(self, running_rows: int) -> tuple[list[tuple[Active, Row]], list[Active]]:
        """This round's share of the waiting prompts: prefill_tokens tokens less one per running row
        (so that, drafting aside, the pass stays within the bound), at least one. Prompts passed over
        `patience` rounds first, the longest passed over first; then the shortest remaining first (module
        docstring). A prompt whose rest fits beside its first token's step joins the batch (`step` feeds
        its rest in its row: `Sequence.unfed`); of a longer one a piece runs as a prefill row.
        Returns (pieces, joining)."""
        room, pieces, joining = max(1, self.prefill_tokens - running_rows), [], []
        line = sorted(self._prompts.items(), key=lambda item: (0, -item[1].passed_over)  # stable: ties keep
                      if item[1].passed_over >= self.patience else (1, len(item[0].seq.unfed)))  # admission order
        for active, waiting in line:
            seq = active.seq
            if room <= 0:
                waiting.passed_over += 1
                continue
            if len(seq.unfed) + 1 <= room:  # the rest and the first token's step, in one row
                joining.append(active)
                room -= len(seq.unfed) + 1
                del self._prompts[active]
                continue
            n = min(room, len(seq.unfed))
            waiting.passed_over = 0
            pieces.append((active, Row(seq.slot.target, seq.unfed[:n], 1)))
            seq.unfed = seq.unfed[n:]
            if not seq.unfed:  # all of it ran: it decodes from the next round
                del self._prompts[active]
            room -= n
        return pieces, joining

    def release(self, active: Active, failed: bool = False) -> None:
        """Drop a request (ended, or its client left) and free its slot; the target keeps the
        request's context for a later prompt that starts the same way, unless its round failed."""
        if active in self.running:
            self.running.remove(active)
            self._prompts.pop(active, None)  # mid-prompt: the slot keeps the pieces that ran
            self._free(active.seq.slot, None if failed else active.seq)

    def _recall(self, slot: Slot, ids: Sequence[int]) -> list[int]:
        """Make `slot` hold the longest start of `ids` that it or the prompt cache has; return the
        tokens it then holds. With a prompt cache a free slot holds nothing (`_free` moved its context
        there), so the start comes from the cache or not at all."""
        if self.prompt_cache is None:
            return self._cached(slot)
        _, entry = self.prompt_cache.best(ids)
        if entry is None:
            return []
        self.cached.pop(id(slot), None)  # from here the slot holds the entry, or nothing
        try:
            slot.target.restore(entry.snapshot)
        except RuntimeError:  # the backend found no room for it: compute the prompt instead (same output)
            slot.target.truncate(0)
            return []
        return list(entry.ids)

    def _cached(self, slot: Slot) -> list[int]:
        """The token ids a free slot's target holds (empty when unknown)."""
        owner, ids = self.cached.get(id(slot), (None, []))
        if getattr(slot.target, "owner", owner) is not owner or slot.target.length != len(ids):
            return []  # another generation used this target since
        return ids

    def _free(self, slot: Slot, seq: Seq | None = None) -> None:
        """Free a slot; its target keeps the K/V of `seq`'s context (the cache holds context[:-1],
        or more after a round cut at EOS or the budget: only the context's cells are known; or the
        start of its prompt, when it leaves mid-prompt)."""
        if seq is not None:
            context = seq.prompt + seq.tokens
            kept = context[:min(slot.target.length, len(context) - 1)]
            slot.target.truncate(len(kept))
            if self.prompt_cache is not None and kept:
                # an idle context costs the running rows: in llama.cpp's one KV pool attention spans every
                # slot's cells, and finished contexts in the other slots slowed a lone stream 5-6% (both
                # our server and llama-server). In host memory it costs them nothing, and comes back by
                # `_recall` for a prompt that starts the same way.
                try:
                    self.prompt_cache.put(kept, slot.target.snapshot())
                except (RuntimeError, MemoryError):  # not copied out: a later prompt computes it again
                    pass
                slot.target.truncate(0)
                self.cached.pop(id(slot), None)
            else:
                self.cached[id(slot)] = (seq, kept)
        else:  # a failed round or prefill: the cache's contents are unknown
            self.cached.pop(id(slot), None)
            slot.target.truncate(0)
        for drafter in slot.drafters:
            drafter.reset()
        self.free.append(slot)


def stream_batch(decoder: SpeculativeDecoder, ids: list[list[int]], configs: list[GenerationConfig],
                 speculative: bool = True, stats: Sequence[GenerationStats] | None = None
                 ) -> Iterator[tuple[int, Chunk]]:
    """(prompt index, chunk) for every prompt, decoded as one continuous batch of up to max_batch. A
    failure is raised (every generation stops there)."""
    stats = list(stats) if stats is not None else [GenerationStats() for _ in ids]
    if len(stats) != len(ids):
        raise ValueError(f"got {len(ids)} prompts but {len(stats)} stats objects")
    for s in stats:
        check_stats(s)
    for i, prompt in enumerate(ids):  # refuse up front, not after others have run
        if not prompt or len(prompt) + 1 > decoder.target.max_length:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; the context holds {decoder.target.max_length}: "
                             f"give 1 to {decoder.target.max_length - 1} tokens")
    scheduler = Scheduler(decoder)
    waiting = deque(range(len(ids)))
    try:
        while waiting or scheduler.running:
            while waiting and scheduler.can_admit():
                i = waiting.popleft()
                scheduler.admit(i, ids[i], configs[i], speculative, stats[i])
            for active, chunks in scheduler.step():
                for chunk in chunks:
                    yield active.key, chunk
    finally:
        for active in list(scheduler.running):
            scheduler.release(active)


def generations(decoder: SpeculativeDecoder, ids: list[list[int]], configs: list[GenerationConfig],
                speculative: bool = True) -> list[Generation]:
    """Every prompt's Generation, in order, decoded as one batch."""
    stats = [GenerationStats() for _ in ids]
    chunks: list[list[Chunk]] = [[] for _ in ids]
    for i, chunk in stream_batch(decoder, ids, configs, speculative, stats):
        chunks[i].append(chunk)
    return [Generation("".join(c.text for c in cs), [t for c in cs for t in c.tokens], s, cs)
            for cs, s in zip(chunks, stats)]
