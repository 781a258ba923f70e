"""The engine: requests in, rounds out. One driver for every way a request is decoded.

`add_request` puts a request in (a free slot, or the waiting line), `step` runs one round of
every running request in one target pass and makes each one's new chunks (`Request.take`), and
`abort` ends a request. Generating one request is `add_request` and `step` until it finishes
(`follow`); a batch, the server's worker and the benchmark's methods drive the same `step`.

Failures: with `SchedulerConfig.isolate` (the server's), a request whose round fails (an exception,
not an interrupt) ends alone with its error (`Request.error`): a shared round that fails is rewound
and its rows run one at a time, so the request at fault is found and its neighbours go on as if it
had never been beside them. Without it (the library's), the error is raised and every running
request ends: a caller sees it at once.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

import torch
from transformers import PreTrainedTokenizerBase

from specdecode.backends.protocol import Row, common_prefix
from specdecode.checks import SettingError
from specdecode.core import VERIFY_RULES
from specdecode.core.probs import GREEDY, SamplingParams
from specdecode.core.reproducible import CounterNoise
from specdecode.drafters.protocol import Drafter
from specdecode.engine.calibration import CalibrationStore, calibrate, calibration_key
from specdecode.engine.config import GenerationConfig
from specdecode.engine.policy import AdaptiveK, FixedK, KPolicy
from specdecode.engine.request import Request, State, VerifyRule
from specdecode.engine.round import run_round
from specdecode.engine.scheduler import Scheduler, SchedulerConfig
from specdecode.engine.slot import Slot, prefill
from specdecode.engine.stats import GenerationStats
from specdecode.engine.text import Chunk, TextAssembler


class Engine:
    """Slots (a target sequence and its drafters each), a K policy, a scheduler and its requests.

    policy: the K policy of requests that give no K (an AdaptiveK: its costs measured once, or read
    from `calibration`, a CalibrationStore; each request gets its own acceptance state). tokenizer:
    needed for text requests only (stop strings)."""

    def __init__(self, slots: Sequence[Slot], eos_ids: Iterable[int], policy: AdaptiveK | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, calibration: CalibrationStore | None = None,
                 recalibrate: bool = False, scheduling: SchedulerConfig = SchedulerConfig()) -> None:
        self.slots = list(slots)
        self.target, self.drafters = self.slots[0].target, list(self.slots[0].drafters)
        self.eos_ids = frozenset(eos_ids)
        self.policy = policy if policy is not None else AdaptiveK()
        self.tokenizer = tokenizer
        # where adaptive K's measured costs are kept across processes (None: measured per process)
        self.calibration, self.recalibrate = calibration, recalibrate
        self.scheduler = Scheduler(self.slots, scheduling)
        self.isolated = 0  # shared rounds that failed and ran row by row (`_alone`): a count for /metrics
        self.pass_tokens = 0  # tokens in the last round's pass, prompts' pieces included (0: no pass)
        self.pass_rows = 0  # sequences in the last round's pass: decoding rows and prompts' pieces

    @property
    def max_batch(self) -> int:
        return len(self.slots)

    @property
    def scheduling(self) -> SchedulerConfig:
        return self.scheduler.config

    def set_scheduling(self, config: SchedulerConfig) -> None:
        """Schedule from now on by `config` (a server's worker takes the engine so); no request may be in."""
        if self.scheduler.running or self.scheduler.waiting:
            raise RuntimeError("the engine's scheduling can only change while it holds no request")
        self.scheduler = Scheduler(self.slots, config)

    def can_admit(self) -> bool:
        return self.scheduler.can_admit()

    # --- requests -------------------------------------------------------------------------
    def add_request(self, ids: Sequence[int], config: GenerationConfig = GenerationConfig(), *,
                    key: Hashable = None, speculative: bool = True, stats: GenerationStats | None = None,
                    text: bool = False, policy: KPolicy | None = None, rule: VerifyRule | None = None,
                    generator: torch.Generator | CounterNoise | None = None) -> Request:
        """A request (checked), in a free slot at once if one is free and none waits, else waiting.

        text: its chunks carry text and its stop strings end it (needs the tokenizer). policy: how many
        tokens it drafts (default: FixedK(config.k), else the engine's). rule: its verification rule
        (default: the config's `verification`; the audit passes its negative controls). generator: its
        randomness (default: from config.seed). Raises ValueError for a request that cannot run (a
        prompt longer than the context), before it takes a slot."""
        check_request(config, speculative, stats)
        ids = check_ids(ids, self.target.vocab_size)
        if len(ids) + 1 > self.target.max_length:
            setting = self.target.context_setting  # what sets the context, if the user can
            raise SettingError(f"the prompt has {len(ids)} tokens but {self.target.name} has a context of "
                               f"{self.target.max_length} (the prompt and one new token at least must fit): "
                               f"shorten the prompt" + (f" or raise {{{setting}}}" if setting else ""))
        stats = stats if stats is not None else GenerationStats()
        if text and self.tokenizer is None:
            raise ValueError("a text request needs the engine's tokenizer")
        if policy is None:
            policy = FixedK(config.k) if config.k is not None else self.policy  # the engine's: a copy at admission
        if generator is None:
            generator = CounterNoise(config.seed) if config.reproducible else torch.Generator().manual_seed(config.seed)
        request = Request(key, ids, config, policy, rule if rule is not None else VERIFY_RULES[config.verification],
                          generator, self.eos_ids, stats, speculative,
                          TextAssembler(self.tokenizer, config.stop, stats) if text else None)
        if self.scheduler.can_admit() and not self.scheduler.waiting:
            self._admit(request)
        else:
            self.scheduler.waiting.append(request)
        return request

    def step(self) -> list[Request]:
        """One round of every running request (the waiting ones take the slots freed since first); the
        requests it advanced, each with its new chunks to `take`. Those that end are FINISHED and free
        their slots. If the round fails: with `isolate`, the requests at fault are FINISHED with their
        `error` (`_alone`); else, as on an interrupt (KeyboardInterrupt and the like, always), every
        running request ends and the error is raised."""
        advanced = self._admit_waiting()
        batch, pieces = self.scheduler.schedule()
        isolate = self.scheduling.isolate
        marks = [_Mark.of(r) for r in [*batch, *(r for r, _ in pieces)]] if isolate else []
        n_prompt = sum(len(row.tokens) for _, row in pieces) + sum(len(r.unfed) for r in batch)
        t0 = time.perf_counter()
        try:
            chunks = run_round(batch, [row for _, row in pieces])
        except Exception as exc:
            if not isolate:
                self._end_all()
                raise
            advanced += self._alone(batch, pieces, marks, exc)
        except BaseException:
            self._end_all()
            raise
        else:
            # the prompts' pieces' share of the pass, by tokens, is their prefill time (a prompt's rest in
            # its own row: the round counts its share)
            t_pass = time.perf_counter() - t0
            self.pass_tokens = n_pass = n_prompt + sum(r.stats.rounds[-1].verified for r in batch)
            self.pass_rows = len(batch) + len(pieces)
            for r, row in pieces:
                r.stats.t_prefill += t_pass * len(row.tokens) / n_pass
            advanced += [self._emit(r, chunk) for r, chunk in zip(batch, chunks)]
        self._forget_if_idle()
        return advanced

    def abort(self, request: Request) -> None:
        """End `request` now (its client left, even mid-prompt); its slot is free at once and keeps what
        ran of its context."""
        if not request.finished:
            self.scheduler.release(request)
            self._forget_if_idle()

    def follow(self, request: Request) -> Iterator[Chunk]:
        """`request`'s chunks as the engine's rounds make them, to its end (the rounds advance every
        running request; the others' chunks wait for their own readers). Closing it aborts the request."""
        try:
            while True:
                if request.outbox:  # made by this request's rounds, or by another reader's steps meanwhile
                    yield from request.take()
                elif request.error is not None:
                    raise request.error
                elif request.finished:
                    return
                else:
                    self.step()
        finally:
            self.abort(request)

    def generate_ids(self, ids: Sequence[int], config: GenerationConfig = GenerationConfig(), *,
                     stats: GenerationStats | None = None, speculative: bool = True) -> list[int]:
        """Token ids in, generated token ids out (no text processing, no stop strings)."""
        request = self.add_request(ids, config, speculative=speculative, stats=stats)
        return [t for chunk in self.follow(request) for t in chunk.tokens]

    def calibrate(self, ids: Sequence[int], params: SamplingParams = GREEDY) -> None:
        """Give adaptive K its costs: from the calibration cache if it has them for this machine,
        models and drafters, else measured after `ids` (and saved). Runs before the first adaptive
        request by itself; call it earlier to keep it out of that request's latency."""
        if not self.drafters:
            return
        if not self.scheduler.free:
            raise RuntimeError("calibrate() needs a free slot: measuring resets its caches")
        slot = self.scheduler.free[0]
        self._calibrate(self.policy, slot, list(ids), params)
        self.scheduler.forget(slot)

    # --- admission --------------------------------------------------------------------------
    def _admit(self, request: Request) -> None:
        """Put a request into the free slot that suits it: its policy calibrated if it must be, the longest
        start of its prompt the slot or the prompt cache holds kept, the rest left for the rounds."""
        slot = request.slot = self.scheduler.take_slot(request.prompt)
        try:
            policy = request.policy
            if request.drafters and policy.wants_calibration():
                self._calibrate(policy, slot, request.prompt, request.config.sampling)
                self.scheduler.forget(slot)  # measured in it: what it held is gone (the prompt runs afresh)
            if policy is self.policy:
                request.policy = policy.for_request()  # the measured costs, its own acceptance evidence
            cached = self.scheduler.recall(slot, request.prompt)
            t0 = time.perf_counter()
            request.stats.prompt_tokens = len(request.prompt)
            request.stats.cached_tokens = keep = common_prefix(cached, request.prompt[:-1])
            prefill(slot.target, slot.drafters, request.prompt, keep, run=False)
            # the rest but the last token: the rounds run it, the last of it in the pass that yields the first
            # token (one pass, as llama.cpp's generate and server do, not a prompt pass and then a step)
            request.unfed = request.prompt[keep:-1]
            request.policy.begin()
            request.stats.t_prefill = time.perf_counter() - t0
        except BaseException:
            request.slot = None
            self.scheduler.free_slot(slot)
            raise
        self.scheduler.start(request)

    def _admit_waiting(self) -> list[Request]:
        """Waiting requests into the free slots, in arrival order; those that failed to (isolated)."""
        failed = []
        while self.scheduler.waiting and self.scheduler.can_admit():
            request = self.scheduler.waiting.popleft()
            try:
                self._admit(request)
            except Exception as exc:
                request.state = State.FINISHED
                if not self.scheduling.isolate:
                    raise
                request.error = exc
                failed.append(request)
        return failed

    def _calibrate(self, policy: KPolicy, slot: Slot, prompt: list[int], params: SamplingParams) -> None:
        measure = lambda: calibrate(policy, slot, prompt, params)  # noqa: E731
        if self.calibration is None:
            measure()
        else:
            self.calibration.ensure(policy, calibration_key(self.target, self.drafters), measure, self.recalibrate)
            self.recalibrate = False  # once per engine

    # --- a round's end ----------------------------------------------------------------------
    def _emit(self, request: Request, chunk: Chunk) -> Request:
        """A round's tokens into the request's chunks (its text, when it has a text layer: a stop string
        ends it); a request that ended leaves, and so does one whose text failed."""
        try:
            if request.text is None:
                request.outbox.append(chunk)
            else:
                request.outbox += request.text.chunks(chunk.tokens, chunk.sources, request.finished)
                if request.text.stopped:  # a stop string: the output ends here
                    request.state = State.FINISHED
        except Exception as exc:
            if not self.scheduling.isolate:
                self.scheduler.release(request, failed=True)
                raise
            return self._fail(request, exc)
        if request.finished:
            self.scheduler.release(request)
        return request

    def _alone(self, batch: list[Request], pieces: list[tuple[Request, Row]], marks: list["_Mark"],
               exc: Exception) -> list[Request]:
        """A round failed with `exc`. Alone in its pass, the request fails. Shared, the pass's rows are
        rewound (each target's cache and generator as before the round: `_Mark`) and each runs alone:
        the ones that fail alone end with their error, and the others get the round they would have had
        alone (from the same state: a seeded request's generator is put back; the drafters follow the
        unchanged context). A failure that only a shared pass meets (e.g. no room for all its rows in a
        KV pool) costs that round one pass per row, and the next round tries the shared pass again."""
        self.pass_tokens = self.pass_rows = 0  # no shared pass ran
        if len(marks) == 1:
            return [self._fail(marks[0].request, exc)]
        self.isolated += 1
        try:
            for mark in marks:
                mark.rewind()
        except Exception:  # the caches' contents are unknown: every request of the round fails
            return [self._fail(mark.request, exc) for mark in marks]
        out = []
        for request, row in pieces:  # a prompt's piece (its tokens already taken from `unfed`)
            try:
                run_round([], [row])
            except Exception as own:
                out.append(self._fail(request, own))
        for request in batch:
            try:
                chunk = run_round([request])[0]
            except Exception as own:
                out.append(self._fail(request, own))
                continue
            out.append(self._emit(request, chunk))
        return out

    def _fail(self, request: Request, exc: Exception) -> Request:
        """End a request with its error: it leaves the batch, its slot's cache dropped."""
        request.error = exc
        self.scheduler.release(request, failed=True)
        return request

    def _end_all(self) -> None:
        for request in list(self.scheduler.running):
            self.scheduler.release(request, failed=True)

    def _forget_if_idle(self) -> None:
        if not self.scheduling.persistent and not self.scheduler.running and not self.scheduler.waiting:
            self.scheduler.forget()


@dataclass(frozen=True, slots=True)
class _Mark:
    """Where a row of a round stood before the round: its target's cache length and its generator's
    state (what `rewind` puts back when the shared round fails: `Engine._alone`)."""

    request: Request
    length: int
    generator: torch.Tensor | None  # a torch generator's state (None: CounterNoise, a function of position)

    @staticmethod
    def of(request: Request) -> "_Mark":
        source = request.generator
        return _Mark(request, request.slot.target.length,
                     source.get_state() if isinstance(source, torch.Generator) else None)

    def rewind(self) -> None:
        self.request.slot.target.truncate(self.length)  # drops what the pass wrote, a tree's scratch too
        if self.generator is not None:
            self.request.generator.set_state(self.generator)


def generate_tokens(target, drafters: Sequence[Drafter], prompt: Sequence[int], config: GenerationConfig,
                    eos_ids: Iterable[int], stats: GenerationStats | None = None, policy: KPolicy | None = None,
                    rule: VerifyRule | None = None) -> Iterator[Chunk]:
    """The chunks of each round of one request on `target` with `drafters`, until EOS or
    max_new_tokens (never overshot). The request is checked here, before the first round."""
    engine = Engine([Slot(target, tuple(drafters))], eos_ids)
    return engine.follow(engine.add_request(prompt, config, stats=stats, policy=policy, rule=rule))


def check_request(config, speculative, stats=None) -> None:
    """The arguments every request takes, of the types it reads (a dict for a config failed later
    with an AttributeError; speculative="no" was truthy)."""
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}: build one with "
                        f"GenerationConfig(max_new_tokens=..., ...)")
    if not isinstance(speculative, bool):
        raise TypeError(f"speculative must be True or False, got {speculative!r}")
    check_stats(stats)


def check_stats(stats) -> None:
    """`stats`, where a caller passes one to be filled in: None or a GenerationStats."""
    if stats is not None and not isinstance(stats, GenerationStats):
        raise TypeError(f"stats must be a GenerationStats (or None), got {type(stats).__name__}")


def check_ids(ids, vocab_size: int) -> list[int]:
    """A prompt of token ids, as a list of ints in [0, vocab_size): an id out of range failed deep in the
    backend (torch's embedding, or llama_decode), a string or floats with a message about dimensions."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
        raise TypeError(f"token ids must be a list of ints, got {type(ids).__name__}; for text use stream() or "
                        f"generate()")
    ids = list(ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"token ids must be ints, got {t!r} ({type(t).__name__}) at index {i}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} at index {i} is outside the model's vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]
