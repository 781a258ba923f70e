"""The generation queue: requests wait in a bounded FIFO and one worker thread serves them.

The event loop never runs model code: handlers submit a Job and await its events,
which the worker pushes thread-safely. Jobs are served in arrival order. A job is
a self-contained unit (prompt ids + frozen config + event sink), so a future
worker can drain several at once and batch them without changing the handlers.

Cancellation: a client that disconnects sets `job.cancelled`; the worker checks it
after every round (so it stops within one round) and then frees the caches.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import Chunk, SpeculativeDecoder
from specdecode.engine.stats import GenerationStats
from specdecode.server.metrics import Metrics


class QueueFull(Exception):
    pass


@dataclass
class Job:
    ids: list[int]
    config: GenerationConfig
    speculative: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("chunk", Chunk) | ("done", stats) | ("error", msg)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stats: GenerationStats = field(default_factory=GenerationStats)

    def push(self, kind: str, payload) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class GenerationQueue:
    def __init__(self, decoder: SpeculativeDecoder, metrics: Metrics, max_queue: int = 16) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.decoder, self.metrics = decoder, metrics
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._serve, name="specdecode-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)

    def submit(self, job: Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"the server is busy: {self._jobs.maxsize} requests are already waiting; "
                            f"retry later") from None
        self.metrics.queued.set(self._jobs.qsize())

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.metrics.queued.set(self._jobs.qsize())
            if job.cancelled.is_set():
                continue
            self.metrics.running.inc()
            try:
                self._run(job)
            except Exception as exc:  # report to the client; the server keeps serving
                job.push("error", f"{type(exc).__name__}: {exc}")
            finally:
                self.decoder.target.truncate(0)  # free the caches of this request
                for drafter in self.decoder.drafters:
                    drafter.reset()
                self.metrics.running.dec()

    def _run(self, job: Job) -> None:
        chunks = self.decoder.stream_ids(job.ids, job.config, speculative=job.speculative, stats=job.stats)
        try:
            for chunk in chunks:
                if job.cancelled.is_set():
                    self.metrics.cancelled.inc()
                    return
                job.push("chunk", chunk)
        finally:
            chunks.close()
            self.metrics.record(job.stats)
        job.push("done", job.stats)


__all__ = ["Chunk", "GenerationQueue", "Job", "QueueFull"]
