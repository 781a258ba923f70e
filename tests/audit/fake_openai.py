"""A small OpenAI-compatible server with a known law, for the black-box audit's tests.

The model is a toy language model over 200 word tokens (tests/toy.py: a fixed random law for every
context; token 0 ends the answer). With speculation on (the default; `{"specdecode": {"speculative":
false}}` turns it off, as on our server) it drafts K = 2 tokens from a noisier toy draft and verifies
them with the real rule (core.verify), so its law is exactly the plain one. A lossy variant breaks it:

    accept-all   every draft accepted (audit.controls.always_accept): drafts follow q, not p
    raw-q        q as the draft's law before top-k/top-p (the drafts were sampled after them)
    hot          the speculative path samples at 1.15 x the requested temperature

Every answer's randomness is a function of (the request body, how many times that body was sent),
so a group's answers are the same whatever order concurrent requests arrive in. Hostile modes: a
refused field, a required key, a delay, 429s with Retry-After, HTML pages, and stopping for good
after some requests (`stop_after`, the server gone mid-run).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import socket
import threading
import time
from collections import Counter

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from specdecode.audit.controls import always_accept
from specdecode.core.probs import SamplingParams, logits_to_probs, sample
from specdecode.core.verify import Randomness, verify
from tests.toy import ToyModel

WORDS = [""] + [f" {c}{v}{end}" for c in "bdfgklmnprstvz" for v in "aeiou" for end in ("", "n", "r")][:199]
V = len(WORDS)  # 200: a long tail, which a temperature change moves mass into
EOS = 0
K = 2
HOT = 1.25  # the "hot" variant's temperature factor
LAWS = ("exact", "accept-all", "raw-q", "hot")
FIELDS = {"model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "user",
          "logprobs", "top_logprobs", "specdecode", "stream", "n", "seed"}


class ToyPair:
    """The target (p) and a draft (q) near it: the draft's logits are the target's plus noise."""

    def __init__(self, seed: int = 7) -> None:
        self.target, self.noise = ToyModel(V, seed, sharpness=2.5), ToyModel(V, seed + 1, sharpness=1.0)

    def target_logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        logits = self.target.logits(ctx).clone()
        logits[EOS] -= 2.5  # answers run a few tokens
        return logits

    def draft_logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        return self.target_logits(ctx) + self.noise.logits(ctx)


def generate(pair: ToyPair, ctx: tuple[int, ...], max_tokens: int, params: SamplingParams, stop: list[str],
             speculative: bool, law: str, generator: torch.Generator,
             counts: Counter | None = None) -> tuple[list[int], str]:
    """The answer's tokens and finish reason; speculative rounds as our engine runs them (K capped by
    the budget left), plain sampling otherwise. `counts` adds up the drafts and the accepted ones."""
    out: list[int] = []
    if speculative and law == "hot" and not params.greedy:
        params = SamplingParams(params.temperature * HOT, params.top_k, params.top_p, params.min_p)
    while len(out) < max_tokens:
        context = ctx + tuple(out)
        k = min(K, max_tokens - len(out) - 1) if speculative else 0
        drafts, qs = [], []
        for _ in range(k):
            q = logits_to_probs(pair.draft_logits(context + tuple(drafts)), params)
            drafts.append(int(sample(q[None], generator, params.greedy)[0]))
            qs.append(q if law != "raw-q" else logits_to_probs(pair.draft_logits(context + tuple(drafts[:-1])),
                                                              SamplingParams(params.temperature or 1.0)))
        ps = torch.stack([logits_to_probs(pair.target_logits(context + tuple(drafts[:i])), params)
                          for i in range(k + 1)])
        if k:
            rule = always_accept if law == "accept-all" else verify
            result = rule(torch.tensor([drafts]), torch.stack(qs)[None], ps[None], Randomness.draw(1, k, generator))
            emitted = result.emitted(0)
            if counts is not None:
                counts.update(draft=k, accepted=int(result.n_accepted[0]))
        else:
            emitted = [int(sample(ps[:1], generator, params.greedy)[0])]
        for token in emitted:
            if token == EOS:
                return out, "stop"
            out.append(token)
            text = "".join(WORDS[t] for t in out)
            if any(s in text for s in stop):
                return out, "stop"
            if len(out) == max_tokens:
                break
    return out, "length"


def fake_app(law: str = "exact", logprobs: str | None = "processed", refuse: frozenset[str] = frozenset(),
             api_key: str | None = None, delay: float = 0.0, busy: int = 0, html: bool = False,
             stop_after: int | None = None, seed: int = 7, owner: str = "fake", speculates: bool = True) -> FastAPI:
    """The app; `logprobs`: "processed" (the law it samples), "raw" (before temperature and truncation,
    as vLLM reports by default) or None (refused, as our server does); owner "specdecode" passes for ours;
    `speculates`: whether a request without the specdecode field speculates (a deployment with or without
    a drafter). GET /metrics counts the drafts as vLLM and llama-server name them."""
    assert law in LAWS
    app = FastAPI()
    pair = ToyPair()  # one model for every fake: `seed` is the randomness of its answers
    sent: Counter = Counter()
    drafts: Counter = Counter()
    app.state.requests = 0
    app.state.server = None  # the uvicorn server, for stop_after

    def error(status: int, message: str, headers=None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status, headers)

    @app.middleware("http")
    async def hostile(request: Request, call_next):
        if html:
            return HTMLResponse("<html><body><h1>Welcome</h1></body></html>")
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "Incorrect API key provided")
        app.state.requests += 1
        if stop_after is not None and app.state.requests > stop_after and app.state.server is not None:
            app.state.server.should_exit = True
        if busy and app.state.requests <= busy:
            return error(429, "busy", {"Retry-After": "1"})
        if delay:
            await asyncio.sleep(delay)
        return await call_next(request)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(f"vllm:spec_decode_num_draft_tokens_total {drafts['draft']}\n"
                                 f"vllm:spec_decode_num_accepted_tokens_total {drafts['accepted']}\n")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "toy", "object": "model", "owned_by": owner}]}

    async def complete(request: Request, chat: bool):
        body = await request.json()
        unknown = set(body) - FIELDS
        if unknown:
            return error(400, f"{sorted(unknown)[0]}: unknown field")
        for name in refuse & set(body):
            return error(400, f"{name} is not supported")
        wants = body.get("logprobs")
        if wants not in (None, False) and logprobs is None:
            return error(400, "logprobs is not supported")
        if body.get("model") != "toy":
            return error(404, f"The model {body.get('model')!r} does not exist")
        top_k = body.get("top_k", 0)
        params = SamplingParams(body.get("temperature", 1.0), max(top_k, 0), body.get("top_p", 1.0),
                                body.get("min_p", 0.0))
        text = json.dumps(body["messages"] if chat else body["prompt"])
        ctx = (int(hashlib.sha256(text.encode()).hexdigest(), 16) % V,)
        key = json.dumps(body, sort_keys=True)
        sent[key] += 1
        digest = hashlib.sha256(f"{seed}|{key}|{sent[key]}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        speculative = (body.get("specdecode") or {}).get("speculative", speculates)
        stop = body.get("stop") or []
        tokens, finish = generate(pair, ctx, body.get("max_tokens", 16), params, [stop] if isinstance(stop, str)
                                  else stop, speculative, law, generator, drafts)
        out = "".join(WORDS[t] for t in tokens)
        n_top = (body.get("top_logprobs", 0) if chat else wants) if wants else 0
        lp = _logprobs(pair, ctx, tokens, params if logprobs == "processed" else SamplingParams(), n_top, chat) \
            if wants else None
        usage = {"prompt_tokens": 5, "completion_tokens": len(tokens), "total_tokens": 5 + len(tokens)}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": finish,
                      "logprobs": lp}
        else:
            choice = {"index": 0, "text": out, "finish_reason": finish, "logprobs": lp}
        return {"id": "x", "object": "chat.completion" if chat else "text_completion", "model": "toy",
                "choices": [choice], "usage": usage}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, chat=True)

    return app


def _logprobs(pair: ToyPair, ctx: tuple[int, ...], tokens: list[int], params: SamplingParams, n_top: int,
              chat: bool) -> dict:
    """Each token's logprob and the n_top likeliest, under `params` (greedy reports the raw law)."""
    rows = []
    for i, t in enumerate(tokens):
        p = logits_to_probs(pair.target_logits(ctx + tuple(tokens[:i])), params if not params.greedy else SamplingParams())
        top = torch.topk(p, n_top).indices.tolist() if n_top else []
        rows.append((WORDS[t], _log(p[t]), [(WORDS[j], _log(p[j])) for j in top if p[j] > 0]))
    if chat:
        return {"content": [{"token": w, "logprob": lp, "top_logprobs": [{"token": a, "logprob": b} for a, b in top]}
                            for w, lp, top in rows]}
    return {"tokens": [w for w, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [dict(top) for _, _, top in rows]}


def _log(x: torch.Tensor) -> float:
    return math.log(float(x)) if float(x) > 0 else -1e30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """An app on a free loopback port, served by uvicorn in a thread, as a context manager."""

    def __init__(self, app) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off"))
        if hasattr(app, "state"):
            app.state.server = self.server
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
