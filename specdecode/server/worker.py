"""The generation queue: requests wait in a bounded FIFO and one worker thread serves them.

The event loop never runs model code: handlers submit a Job and await its events,
which the worker pushes thread-safely. Jobs are served in arrival order. A job is
a self-contained unit (prompt ids + frozen config + event sink), so a future
worker can drain several at once and batch them without changing the handlers.

Cancellation: a client that disconnects sets `job.cancelled`; the worker checks it
after every round (so it stops within one round) and then frees the caches. A
cancelled job that is still waiting no longer holds a queue slot.

Shutdown: `abort_all` ends every running and waiting job with a 503 error event
and refuses new ones.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass, field

from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import Chunk, SpeculativeDecoder
from specdecode.engine.stats import GenerationStats
from specdecode.server.metrics import Metrics


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass
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

    def push(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def abort(self, message: str) -> None:
        self.aborted = True
        self.cancelled.set()
        self.push("error", (503, message))


class GenerationQueue:
    def __init__(self, decoder: SpeculativeDecoder, metrics: Metrics, max_queue: int = 16) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.decoder, self.metrics, self.max_queue = decoder, metrics, max_queue
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
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
            jobs = [*self._waiting, *([self._running] if self._running else [])]
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
        with self._cond:
            while not self._waiting and not self._stop:
                self._cond.wait()
            if self._stop:
                return None
            self._running = self._waiting.popleft()
            return self._running

    def _serve(self) -> None:
        while (job := self._next()) is not None:
            try:
                if job.cancelled.is_set():  # the client left while waiting
                    if not job.aborted:
                        self.metrics.cancelled.inc()
                    continue
                self.metrics.running.inc()
                try:
                    self._run(job)
                except Exception as exc:  # report to the client; the server keeps serving
                    job.push("error", (500, f"{type(exc).__name__}: {exc}"))
                finally:
                    self.decoder.target.truncate(0)  # free the caches of this request
                    for drafter in self.decoder.drafters:
                        drafter.reset()
                    self.metrics.running.dec()
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        chunks = self.decoder.stream_ids(job.ids, job.config, speculative=job.speculative, stats=job.stats)
        try:
            for chunk in chunks:
                if job.cancelled.is_set():
                    if not job.aborted:
                        self.metrics.cancelled.inc()
                    return
                job.push("chunk", chunk)
        finally:
            chunks.close()
            self.metrics.record(job.stats)
        job.push("done", job.stats)


__all__ = ["Chunk", "GenerationQueue", "Job", "QueueFull", "ShuttingDown"]
