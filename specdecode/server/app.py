"""The FastAPI app: OpenAI-shaped completions and chat completions, streaming, metrics.

Handlers validate, tokenize (in a small thread pool, off the event loop), submit
a Job to the GenerationQueue and await its events; they never run the model
themselves, so the event loop stays free. Every error, including FastAPI's own
404/405/body-parsing errors and oversized bodies, is OpenAI-shaped
({"error": {"message", "type", "param", "code"}}) and counted in the metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.core.probs import SamplingParams
from specdecode.engine.config import DEFAULT_PREFILL_TOKENS, GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.stats import GenerationStats
from specdecode.server.metrics import Metrics
from specdecode.server.schemas import ChatRequest, CompletionRequest, FieldError
from specdecode.server.worker import GenerationQueue, Job, QueueFull, ShuttingDown

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
DEFAULT_CHAT_MAX_TOKENS = 512  # chat has no OpenAI default; without one a reply could run to the end of the context
DEFAULT_MAX_BODY_BYTES = 4 * 2 ** 20
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
DISCONNECT_POLL_S = 0.05  # how often a non-streaming handler checks that its client is still there
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
# pydantic appends the union branch it tried to an error's location ("prompt", "str"): not a field
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|function-\w+)(\[.*\])?$")
# errors about the request body as a whole: absent, not JSON, or JSON but not an object
_BODY_ERRORS = {"missing", "model_attributes_type", "model_type", "dict_type"}
_JSON_KINDS = {type(None): "null", list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean"}
_KINDS = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
          429: "server_busy", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers, code


def no_such_model(name: str, model_id: str) -> ApiError:
    """OpenAI's answer to a model it does not serve: 404, code model_not_found (a request's model or
    GET /v1/models/<name>)."""
    return ApiError(404, f"no such model {name!r}; this server serves {model_id!r}", "model", code="model_not_found")


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | None = None) -> JSONResponse:
    kind = _KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(error_body(message, param, kind, code), status_code=status, headers=headers)


def create_app(decoder: SpeculativeDecoder, model_id: str, max_queue: int = 16,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, prompt_cache_bytes: int = 0,
               prefill_tokens: int = DEFAULT_PREFILL_TOKENS) -> FastAPI:
    metrics = Metrics()
    jobs = GenerationQueue(decoder, metrics, max_queue, prompt_cache_bytes, prefill_tokens)
    # tokenizing a long prompt takes seconds; on the event loop it would stall every other request
    tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specdecode-tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        jobs.start()
        yield
        jobs.stop()
        tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # redirect_slashes off: "/v1/completions/" would get a bare 307 to a URL built from the Host header;
    # a 404 in the OpenAI shape names the path instead
    app = FastAPI(title="specdecode", lifespan=lifespan, redirect_slashes=False)
    app.state.metrics, app.state.jobs = metrics, jobs
    app.add_middleware(BodyLimit, limit=max_body_bytes, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
        param = ".".join(loc) or None
        cause = err.get("ctx", {}).get("error")
        message = str(cause) if isinstance(cause, ValueError) else err.get("msg", "invalid request")
        if isinstance(cause, FieldError):
            param = cause.param
        elif not loc and err.get("type") in _BODY_ERRORS:  # the body as a whole: pydantic's words name no cause
            message = _body_error(err, request.headers.get("content-type"))
        elif err.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        elif err.get("type") == "extra_forbidden":
            message = f"{param}: unknown field (not supported by this server)"
        elif param:
            message = f"{param}: {message}"
        count(metrics, request.url.path, 400)
        return error_response(400, message, param)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        count(metrics, request.url.path, exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.headers, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own errors: unknown path, wrong method, a body it could not parse (bad UTF-8, too deep)
        count(metrics, request.url.path, exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400:  # FastAPI's "There was an error parsing the body" says nothing of why
            message = ("the request body could not be parsed as JSON (invalid UTF-8, nested too deeply, or an "
                       "integer of more than 4300 digits)")
        return error_response(exc.status_code, message, None, exc.headers)

    # HEAD beside GET on the read-only endpoints: load balancers health-check with HEAD
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": model_id}

    card = {"id": model_id, "object": "model", "created": 0, "owned_by": "specdecode"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [card]}

    @app.api_route("/v1/models/{name:path}", methods=["GET", "HEAD"])  # a path: model ids may hold slashes ("org/model")
    async def model(name: str):
        if name != model_id:
            raise no_such_model(name, model_id)
        return card

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(request, body, body.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        return await _respond(request, body, messages, chat=True)

    async def _respond(request: Request, body, prompt, chat: bool):
        if body.model != model_id:
            raise no_such_model(body.model, model_id)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(tokenize_pool, _encode, decoder, prompt, chat)
        config = _config(decoder, body, ids, chat)
        job = Job(ids, config, body.specdecode.speculative, loop)
        try:
            jobs.submit(job)
        except QueueFull as exc:
            raise ApiError(429, str(exc), None, {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc)) from None
        kind = "chat.completion" if chat else "text_completion"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_sse(job, rid, created, kind, include_usage, request.url.path),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(_watch(request, job))
        text = []
        try:
            while True:
                event, payload = await job.events.get()
                if event == "chunk":
                    text.append(payload.text)
                elif event == "gone":
                    count(metrics, request.url.path, 499)  # nginx's "client closed request"; nobody reads it
                    return Response(status_code=499)
                elif event == "error":
                    status, message = payload
                    count(metrics, request.url.path, status)
                    return error_response(status, message)
                else:
                    break
        finally:
            watcher.cancel()
            job.cancelled.set()  # a no-op when done; stops the worker on an error or cancellation
        count(metrics, request.url.path, 200)
        stats: GenerationStats = payload
        return {"id": rid, "object": kind, "created": created, "model": model_id,
                "choices": [_choice(kind, "".join(text), stats.finish_reason)], "usage": _usage(job, stats)}

    async def _sse(job: Job, rid: str, created: int, kind: str, include_usage: bool, path: str
                   ) -> AsyncIterator[str]:
        """The stream's events. Its status is counted when it ends, as it ended: 200 after [DONE], the
        error's status after an error event, 499 when the client left first (the HTTP status line went
        out as 200 with the first byte, but the metrics say how each request really ended)."""
        chunk_kind = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
        first, status = True, 499
        try:
            while True:
                event, payload = await job.events.get()
                if event == "chunk":
                    if payload.text or first:
                        yield _event(rid, chunk_kind, created, model_id, [_delta(kind, payload.text, None, first)])
                        first = False
                elif event == "error":
                    status, message = payload
                    kind_ = _KINDS.get(status, "server_error")
                    yield f"data: {json.dumps(error_body(message, None, kind_))}\n\n"
                    return
                else:
                    status = 200
                    usage = _usage(job, payload)
                    final = _delta(kind, "", payload.finish_reason, first, last=True)
                    if include_usage:  # OpenAI: a separate last chunk with no choices carries the usage
                        yield _event(rid, chunk_kind, created, model_id, [final])
                        yield _event(rid, chunk_kind, created, model_id, [], usage=usage)
                    else:  # our extension: the final chunk carries usage (and so the seed) anyway
                        yield _event(rid, chunk_kind, created, model_id, [final], usage=usage)
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancelled.set()  # client disconnected (or finished): the worker stops within a round
            count(metrics, path, status)

    return app


async def _watch(request: Request, job: Job) -> None:
    """A non-streaming client that hangs up must stop its generation too, within a round."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    job.cancelled.set()
    job.events.put_nowait(("gone", None))


def _body_error(err: dict, content_type: str | None) -> str:
    body = err.get("input")
    if err.get("type") == "missing":
        return "the request body is empty: send a JSON object"
    if isinstance(body, bytes):
        # FastAPI parses a body as JSON only under a JSON Content-Type. We keep that rule rather than
        # parse any body: a browser page may POST text/plain or form bodies cross-site without a CORS
        # preflight, application/json it may not, so this stops other sites driving a local server.
        got = f"it was sent as {content_type!r}" if content_type else "it was sent without one"
        return f"the request body must be a JSON object sent with Content-Type: application/json ({got})"
    kind = _JSON_KINDS.get(type(body), type(body).__name__)
    return f"the request body must be a JSON object, got {kind}"


def _encode(decoder: SpeculativeDecoder, prompt, chat: bool) -> list[int]:
    param = "messages" if chat else "prompt"
    try:
        return decoder.encode(prompt, chat)
    except ValueError as exc:  # e.g. a prompt of which the tokenizer keeps nothing
        raise ApiError(400, f"{param}: {exc}", param) from None


def _config(decoder: SpeculativeDecoder, body, ids: list[int], chat: bool) -> GenerationConfig:
    context = decoder.target.max_length
    param = "messages" if chat else "prompt"
    room = context - len(ids) - 1
    if room < 1:
        raise ApiError(400, f"{param}: the prompt is {len(ids)} tokens, which leaves no room for a completion in "
                            f"the model's context of {context} tokens", param)
    limit = body.limit
    if limit is None:
        limit = min(DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS, room)
    elif limit > room:
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise ApiError(400, f"prompt ({len(ids)} tokens) + {name} ({limit}) exceeds the context of "
                            f"{context} tokens", name)
    # no seed: a fresh one (sampling must be random), reported in usage.specdecode.seed for replay
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    try:
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                  min_p=body.min_p)
        return GenerationConfig(max_new_tokens=limit, sampling=sampling, k=body.specdecode.k, seed=seed,
                                stop=body.stop_strings, verification=body.specdecode.verification,
                                reproducible=body.specdecode.reproducible)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def _choice(kind: str, text: str, finish: str) -> dict:
    if kind == "text_completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}


def _delta(kind: str, text: str, finish: str | None, first: bool, last: bool = False) -> dict:
    if kind == "text_completion":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    # OpenAI's last chat chunk (the one with finish_reason) has an empty delta
    delta = {"role": "assistant", "content": text} if first else {} if last and not text else {"content": text}
    return {"index": 0, "delta": delta, "finish_reason": finish}


def _event(rid: str, kind: str, created: int, model: str, choices: list, usage: dict | None = None) -> str:
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return "data: " + json.dumps(body) + "\n\n"


def _usage(job: Job, stats: GenerationStats) -> dict:
    n = len(job.ids)
    return {"prompt_tokens": n, "completion_tokens": stats.new_tokens, "total_tokens": n + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},  # as OpenAI reports it
            "specdecode": {"seed": job.config.seed, "rounds": stats.num_rounds, "drafted": stats.drafted,
                           "accepted": stats.accepted, "accepted_per_position": stats.accepted_per_position,
                           "alpha": stats.alpha, "mean_acceptance_length": stats.mean_acceptance_length}}


def count(metrics: Metrics, path: str, status: int) -> None:
    endpoint = path if path in ENDPOINTS else "other"  # arbitrary 404 paths must not mint new label values
    metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


class BodyLimit:
    """ASGI middleware: read the request body up to `limit` bytes before the app sees it, and answer a
    larger one with a 413 without buffering it whole. Later receive() calls go to the server again, so
    disconnect detection still works."""

    def __init__(self, app, limit: int, metrics: Metrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._reject(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._reject(scope, receive, send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send) -> None:
        count(self.metrics, scope["path"], 413)
        response = error_response(413, f"the request body exceeds the server's limit of {self.limit} bytes "
                                       f"(serve --max-body-bytes)")
        await response(scope, receive, send)
