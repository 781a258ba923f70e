"""The FastAPI app: OpenAI-shaped completions and chat completions, streaming, metrics.

Handlers validate, tokenize, submit a Job to the GenerationQueue and await its
events; they never run the model themselves, so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdecode.core.probs import SamplingParams
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.stats import GenerationStats
from specdecode.server.metrics import Metrics
from specdecode.server.schemas import ChatRequest, CompletionRequest
from specdecode.server.worker import GenerationQueue, Job, QueueFull

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
# pydantic appends the union branch it tried to an error's location ("prompt", "str"): not a field
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|function-\w+)(\[.*\])?$")


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(message: str, param: str | None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def create_app(decoder: SpeculativeDecoder, model_id: str, max_queue: int = 16) -> FastAPI:
    metrics = Metrics()
    jobs = GenerationQueue(decoder, metrics, max_queue)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        jobs.start()
        yield
        jobs.stop()

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.state.metrics, app.state.jobs = metrics, jobs

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
        param = ".".join(loc) or None
        message = err.get("msg", "invalid request")
        if err.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif param:
            message = f"{param}: {message}"
        _count(metrics, request, 400)
        return JSONResponse(error_body(message, param), status_code=400)

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest):
        _count(metrics, request, exc.status)
        kind = "invalid_request_error" if exc.status == 400 else "server_busy"
        return JSONResponse(error_body(exc.message, exc.param, kind), status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "specdecode"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model)
        ids = _encode(decoder, body.prompt, chat=False)
        return await _respond(request, body, ids, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model)
        ids = _encode(decoder, [m.model_dump() for m in body.messages], chat=True)
        return await _respond(request, body, ids, "chat.completion")

    def _check_model(name: str) -> None:
        if name != model_id:
            raise BadRequest(f"unknown model {name!r}; this server serves {model_id!r}", "model")

    async def _respond(request: Request, body, ids: list[int], kind: str):
        max_tokens = body.max_tokens or (DEFAULT_MAX_TOKENS if kind == "text_completion"
                                         else decoder.target.max_length - len(ids) - 1)
        if len(ids) + max_tokens + 1 > decoder.target.max_length:
            raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                             f"{decoder.target.max_length} tokens", "max_tokens")
        try:
            sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p)
            config = GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, k=body.specdecode.k,
                                      seed=body.seed if body.seed is not None else 0, stop=body.stop_strings)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        job = Job(ids, config, body.specdecode.speculative, asyncio.get_running_loop())
        try:
            jobs.submit(job)
        except QueueFull as exc:
            raise BadRequest(str(exc), None, status=429) from None
        rid = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            _count(metrics, request, 200)
            return StreamingResponse(_sse(job, rid, created, kind), media_type="text/event-stream")
        text = []
        try:
            while True:
                event, payload = await job.events.get()
                if event == "chunk":
                    text.append(payload.text)
                elif event == "error":
                    _count(metrics, request, 500)
                    return JSONResponse(error_body(payload, None, "server_error"), status_code=500)
                else:
                    break
        finally:
            job.cancelled.set()  # a no-op when done; stops the worker if the client went away
        _count(metrics, request, 200)
        stats: GenerationStats = payload
        return {"id": rid, "object": kind, "created": created, "model": model_id,
                "choices": [_choice(kind, "".join(text), stats.finish_reason)], "usage": _usage(ids, stats)}

    async def _sse(job: Job, rid: str, created: int, kind: str) -> AsyncIterator[str]:
        chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        first = True
        try:
            while True:
                event, payload = await job.events.get()
                if event == "chunk":
                    if payload.text or first:
                        yield _event(rid, chunk_kind, created, model_id, _delta(kind, payload.text, None, first))
                        first = False
                elif event == "error":
                    yield f"data: {json.dumps(error_body(payload, None, 'server_error'))}\n\n"
                    return
                else:
                    yield _event(rid, chunk_kind, created, model_id, _delta(kind, "", payload.finish_reason, first),
                                 usage=_usage(job.ids, payload))
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancelled.set()  # client disconnected (or finished): the worker stops within a round

    return app


def _encode(decoder: SpeculativeDecoder, prompt, chat: bool) -> list[int]:
    try:
        return decoder.encode(prompt, chat)
    except ValueError as exc:
        raise BadRequest(str(exc), "messages" if chat else "prompt") from None


def _choice(kind: str, text: str, finish: str) -> dict:
    if kind == "text_completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}


def _delta(kind: str, text: str, finish: str | None, first: bool) -> dict:
    if kind == "text_completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    delta = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": 0, "delta": delta, "finish_reason": finish}


def _event(rid: str, kind: str, created: int, model: str, choice: dict, usage: dict | None = None) -> str:
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return "data: " + json.dumps(body) + "\n\n"


def _usage(ids: list[int], stats: GenerationStats) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": stats.new_tokens,
            "total_tokens": len(ids) + stats.new_tokens,
            "specdecode": {"rounds": stats.num_rounds, "drafted": stats.drafted, "accepted": stats.accepted,
                           "accepted_per_position": stats.accepted_per_position, "alpha": stats.alpha,
                           "mean_acceptance_length": stats.mean_acceptance_length}}


def _count(metrics: Metrics, request: Request, status: int) -> None:
    metrics.requests.labels(endpoint=request.url.path, status=str(status)).inc()
