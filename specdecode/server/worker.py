"""The generation queue: requests wait in a bounded FIFO; one worker thread batches them.

The event loop never runs model code: handlers submit a Job and await its events,
which the worker pushes thread-safely. The worker drives the decoder's engine
(engine/engine.py), scheduled for serving: between two rounds it admits waiting jobs in
arrival order into free slots (up to the decoder's max_batch running at once), then runs
one round of every running job in one target pass, with the next piece of the new jobs'
prompts in it (chunked prefill: --prefill-chunk tokens a round, so running streams do
not stall), and pushes each job's new text. A job that
ends leaves the batch at once and frees its slot for the next (its context stays in the slot,
and goes to the prompt cache in host memory before another prompt overwrites it).

Failure: a request whose round fails ends with a 500 naming the error; the requests batched beside it
go on (the engine reruns a failed shared round row by row to find the one at fault).

Cancellation: a client that disconnects sets `job.cancelled`; the worker checks it
before every round (so it stops within one round) and frees the job's slot. A
cancelled job that is still waiting no longer holds a queue slot.

Shutdown: `abort_all` ends every running and waiting job with a 503 error event
and refuses new ones.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specdecode.engine.config import DEFAULT_PREFILL_TOKENS, GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.engine.stats import GenerationStats
from specdecode.engine.text import Chunk
from specdecode.server.metrics import Metrics


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Job:
    ids: list[int]
    config: GenerationConfig
    speculative: bool
    loop: asyncio.AbstractEventLoop
    # ("chunk", Chunk) | ("done", stats) | ("error", (http status, message))
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False  # cancelled by the server (shutdown), not by the client
    stats: GenerationStats = field(default_factory=GenerationStats)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # when its first token was pushed (time to first token)

    def push(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def abort(self, message: str) -> None:
        self.aborted = True
        self.cancelled.set()
        self.push("error", (503, message))


class GenerationQueue:
    def __init__(self, decoder: SpeculativeDecoder, metrics: Metrics, max_queue: int = 16,
                 prompt_cache_bytes: int = 0, prefill_tokens: int = DEFAULT_PREFILL_TOKENS) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.decoder, self.metrics, self.max_queue = decoder, metrics, max_queue
        # a server owns its models: contexts are kept across requests, and a request whose round fails
        # ends alone (its neighbours go on)
        decoder.set_scheduling(SchedulerConfig(prefill_tokens, prompt_cache_bytes, isolate=True, persistent=True))
        self._waiting: deque[Job] = deque()
        self._running: set[Job] = set()  # read by abort_all from another thread: under _cond
        self._closed: str | None = None  # the shutdown message once abort_all ran
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._serve, name="specdecode-worker", daemon=True)
        metrics.queued.set_function(self.waiting)

    def waiting(self) -> int:
        """Jobs waiting whose client is still there (only these hold a queue slot)."""
        with self._cond:
            return sum(not job.cancelled.is_set() for job in self._waiting)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.abort_all("the server is shutting down")
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def abort_all(self, message: str) -> None:
        """End every running and waiting job with a 503 and refuse new ones (shutdown)."""
        with self._cond:
            self._closed = message
            jobs = [*self._waiting, *self._running]
            self._waiting.clear()
        for job in jobs:
            if not job.cancelled.is_set():
                job.abort(message)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise ShuttingDown(self._closed)
            live = deque(j for j in self._waiting if not j.cancelled.is_set())
            self.metrics.cancelled.inc(len(self._waiting) - len(live))  # clients that left while waiting
            self._waiting = live
            if len(live) >= self.max_queue:
                raise QueueFull(f"the server is busy: {self.max_queue} requests are already waiting; retry later")
            self._waiting.append(job)
            self._cond.notify()

    def _next(self) -> Job | None:
        """The next waiting job, if a slot is free (None: none now). Blocks while idle."""
        with self._cond:
            while not self._waiting and not self.decoder.scheduler.running and not self._stop:
                self._cond.wait()
            if self._stop or not self._waiting or not self.decoder.can_admit():
                return None
            job = self._waiting.popleft()
            self._running.add(job)
            return job

    def _serve(self) -> None:
        while not self._stop:
            try:
                self._turn()
            except Exception as exc:  # the worker's own bookkeeping failed: what runs ends, the server serves on
                self._fail_running(exc)

    def _turn(self) -> None:
        """Admit what fits, drop what was cancelled, run a round."""
        while (job := self._next()) is not None:
            self._admit(job)
        for request in list(self.decoder.scheduler.running):
            if request.key.cancelled.is_set():  # the client left (or the server aborted it)
                self.decoder.abort(request)
                self._end(request.key, cancelled=True)
        if self.decoder.scheduler.running:
            self._round()

    def _fail_running(self, exc: Exception) -> None:
        """End every running job with a 500 naming `exc`, their slots freed with caches dropped."""
        for request in list(self.decoder.scheduler.running):
            try:
                self.decoder.scheduler.release(request, failed=True)
            except Exception:  # its slot could not even be emptied: it stays out of use, the others serve on
                pass
        with self._cond:
            jobs = list(self._running)
        for job in jobs:
            if not job.cancelled.is_set():
                job.push("error", (500, f"{type(exc).__name__}: {exc}"))
            self._end(job)

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left while waiting
            self._end(job, cancelled=True, started=False)
            return
        try:
            self.decoder.add_request(job.ids, job.config, key=job, speculative=job.speculative, stats=job.stats,
                                     text=True)
        except Exception as exc:  # report to the client; the server keeps serving
            job.push("error", (400 if isinstance(exc, ValueError) else 500, f"{type(exc).__name__}: {exc}"))
            self._end(job, started=False)
            return
        self.metrics.running.inc()

    def _round(self) -> None:
        engine = self.decoder
        isolated = engine.isolated
        advanced = engine.step()  # a request whose round failed comes back with its error
        self.metrics.isolated.inc(engine.isolated - isolated)
        if engine.pass_tokens:  # the whole pass: new requests' prompts ride in it too
            self.metrics.pass_tokens.observe(engine.pass_tokens)
            self.metrics.batch_size.observe(engine.pass_rows)
        for request in advanced:
            job = request.key
            if request.error is not None:  # this request alone: the rest of the batch goes on
                job.push("error", (500, f"{type(request.error).__name__}: {request.error}"))
                self._end(job)
                continue
            for chunk in request.take():
                if chunk.tokens and job.t_first is None:
                    job.t_first = time.perf_counter()
                    self.metrics.ttft.observe(job.t_first - job.t_submit)
                job.push("chunk", chunk)
            if request.finished:
                self._end(job)
                job.push("done", job.stats)

    def _end(self, job: Job, cancelled: bool = False, started: bool = True) -> None:
        """Account for a job that left the batch (or never entered it)."""
        if cancelled and not job.aborted:
            self.metrics.cancelled.inc()
        if started:
            self.metrics.record(job.stats)
            self.metrics.running.dec()
        with self._cond:
            self._running.discard(job)


__all__ = ["Chunk", "GenerationQueue", "Job", "QueueFull", "ShuttingDown"]
