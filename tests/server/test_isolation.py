"""The server's worker: a request whose round fails gets a 500 naming the error, and only it; the
requests batched beside it stream to their end, exactly as they would alone (in-process: the fault
is injected into the target pass, as a kernel error would arrive)."""

from __future__ import annotations

import asyncio

import torch

from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.policy import AdaptiveK
from specdecode.engine.scheduler import Scheduler
from specdecode.server.metrics import Metrics
from specdecode.server.worker import GenerationQueue, Job
from tests.engine.test_batch import POISON, inject
from tests.tiny import char_tokenizer, tiny_pair


def tiny_decoder(max_batch: int = 3) -> SpeculativeDecoder:
    target, draft = tiny_pair(seed=3, noise=0.05, dtype=torch.float32)
    policy = AdaptiveK(k_max=4)
    policy.load_costs({"t_verify": {str(n): 0.01 for n in range(1, 41)}, "t_step": {"lookup": 1e-5, "model": 1e-3}})
    return SpeculativeDecoder(target, char_tokenizer(), [LookupDrafter(), ModelDrafter(draft)], eos_ids=[0],
                              policy=policy, max_batch=max_batch)


async def outcomes(queue: GenerationQueue, jobs: list[Job], timeout: float = 120
                   ) -> list[tuple[str, object, list[int]]]:
    """Each job's (last event's kind, its payload, the tokens streamed before it)."""
    ends = []
    for job in jobs:
        tokens = []
        while (event := await asyncio.wait_for(job.events.get(), timeout))[0] == "chunk":
            tokens += event[1].tokens
        ends.append((event[0], event[1], tokens))
    return ends


def test_a_failing_request_gets_a_500_and_its_batch_goes_on(monkeypatch):
    decoder = tiny_decoder()
    prompts = ["abcabcab", "ab" + POISON + "cd", "hello hello"]
    config = GenerationConfig(max_new_tokens=24, k=2)
    alone = [decoder.generate(p, config).tokens for p in prompts[::2]]
    failed = inject(monkeypatch, "pass")
    metrics = Metrics()

    async def serve() -> list[tuple[str, object, list[int]]]:
        queue = GenerationQueue(decoder, metrics, max_queue=8)
        jobs = [Job(decoder.encode(p), config, True, asyncio.get_running_loop()) for p in prompts]
        for job in jobs:
            queue.submit(job)  # all waiting before the worker starts: admitted into one batch
        queue.start()
        ends = await outcomes(queue, jobs)
        queue.stop()
        return ends

    ends = asyncio.run(serve())
    assert failed and max(failed) == 3, "the fault never hit a shared pass: the test tests nothing"
    assert [kind for kind, _, _ in ends] == ["done", "error", "done"]
    assert ends[1][1] == (500, "RuntimeError: llama_decode failed with code -1") and not ends[1][2]
    assert [ends[0][2], ends[2][2]] == alone
    assert metrics.running._value.get() == 0 and metrics.isolated._value.get() >= 1


def test_the_worker_survives_a_failure_of_its_own_bookkeeping(monkeypatch):
    """A failure outside any request's round (here the scheduler's admission check, once, while a
    request runs) ends the running requests with a 500 naming it, and the worker serves on: the
    request still waiting and a later one decode as usual. Before, the worker's thread died and
    every request hung."""
    decoder = tiny_decoder(max_batch=2)
    config = GenerationConfig(max_new_tokens=12, k=2)
    expected = [decoder.generate(p, config).tokens for p in ("xyz", "hello hello")]
    real, failed = Scheduler.can_admit, []

    def can_admit(self):
        if self.running and not failed:
            failed.append(1)
            raise IndexError("a scheduler bug")
        return real(self)
    monkeypatch.setattr(Scheduler, "can_admit", can_admit)
    metrics = Metrics()

    async def serve():
        queue = GenerationQueue(decoder, metrics, max_queue=8)
        loop = asyncio.get_running_loop()
        first = [Job(decoder.encode(p), config, True, loop) for p in ("abcabc", "xyz")]
        for job in first:
            queue.submit(job)  # both waiting before the worker starts
        queue.start()
        ends = await outcomes(queue, first, timeout=30)
        later = Job(decoder.encode("hello hello"), config, True, loop)
        queue.submit(later)
        ends += await outcomes(queue, [later], timeout=30)
        queue.stop()
        return ends

    ends = asyncio.run(serve())
    assert failed, "the fault was never injected"
    assert [kind for kind, _, _ in ends] == ["error", "done", "done"]
    assert ends[0][1] == (500, "IndexError: a scheduler bug")
    assert [ends[1][2], ends[2][2]] == expected
    assert metrics.running._value.get() == 0
