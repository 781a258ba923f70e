"""One OpenAI-compatible endpoint over HTTP: the requests the black-box audit sends, and their answers.

Everything an endpoint can do wrong becomes one `EndpointError` line that says what it answered and
what to do: no server at the address, a page that is not JSON (HTML), a refused key, a refused field,
a model it does not serve. Busy and flaky servers are retried: a 429 or 503 after its Retry-After
(or a backoff), a dropped connection or a timeout a few times, once the endpoint has answered at all
(before that, a connection error is the wrong address, reported at once). An answer has `timeout`
seconds in all: a server that trickles bytes forever is a timeout, not a hang.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

RETRIES = 6  # tries of one request that met a 429/503, a dropped connection or a timeout
MAX_WAIT_S = 60.0  # the longest Retry-After honoured (a longer one is waited this long, then retried)
KEY_FIX = "give the right key with --api-key or the OPENAI_API_KEY variable"


class EndpointError(Exception):
    """The endpoint could not be audited as asked (one line: what it answered, and the fix)."""


class Refused(EndpointError):
    """A 400, 404, 405 or 422 for a request: the server does not accept it or one of its fields (what the
    probe asks)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Answer:
    """What one completion returned, as the audit reads it."""

    text: str
    finish_reason: str | None
    completion_tokens: int | None  # usage.completion_tokens
    tokens: tuple[str, ...] | None = None  # the answer's tokens as text, where it carried logprobs
    top: tuple[dict[str, float], ...] | None = None  # per token: text -> logprob of the likeliest ones
    drafted: int | None = None  # usage.specdecode (our server's extension): drafts proposed, accepted
    accepted: int | None = None


@dataclass(frozen=True)
class Side:
    """An endpoint as one side of the audit sees it: its base URL (ending in /v1), the fields merged into
    every request it gets, the key it sends and the model it asks for."""

    name: str  # "endpoint" or "reference"
    url: str
    body: dict | None = field(default_factory=dict)  # None: the audit finds it (run._with_model)
    api_key: str | None = None
    model: str | None = None


def base_url(text: str, option: str) -> str:
    """The API's base URL from what the user gave: `http://host:8000` or `http://host:8000/v1`."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{option} must be an http(s) URL such as http://127.0.0.1:8000, got {text!r}")
    if not parts.hostname:
        raise ValueError(f"{option} {text!r} has no host name: give one, such as http://127.0.0.1:8000")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"{option} {text!r}: the port must be a number from 1 to 65535, such as "
                         f"http://127.0.0.1:8000") from None
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def merge(base: dict, extra: dict) -> dict:
    """`base` with `extra`'s fields merged in, objects recursively (`{"specdecode": {...}}` beside others)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class Client:
    """Requests to the audit's endpoints, at most `concurrency` at a time over all of them."""

    def __init__(self, concurrency: int = 4, timeout: float = 120.0, transport: httpx.AsyncBaseTransport | None = None,
                 retries: int = RETRIES, max_wait: float = MAX_WAIT_S) -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)), limits=limits,
                                      transport=transport)
        self.slots = asyncio.Semaphore(concurrency)
        self.timeout, self.retries, self.max_wait = timeout, retries, max_wait
        self.answered: set[str] = set()  # URLs that answered once: a connection error there is a server gone
        self.retried = 0  # requests sent again (429, 503, dropped connections, timeouts)
        self.notes: set[str] = set()  # what the run should know of how it was served (a Retry-After cut short)

    async def close(self) -> None:
        await self.http.aclose()

    async def models(self, side: Side) -> list[dict]:
        """The models GET /v1/models lists (each with its "id")."""
        doc = await self._send(side, "GET", "/models", None)
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            raise EndpointError(f"{side.url}/models answered JSON without a model list ('data'): is {side.url} an "
                                f"OpenAI-compatible API? (or give --model)")
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def draft_counters(self, side: Side) -> tuple[float, float] | None:
        """(drafted, accepted) tokens so far by the server's Prometheus counters (vLLM's and llama-server's
        `*spec_decode_num_draft_tokens_total`, `*spec_decode_num_accepted_tokens_total`), or None where
        /metrics is not there (it is optional: nothing depends on it but the evidence of drafting)."""
        from prometheus_client.parser import text_string_to_metric_families

        root = side.url[: -len("/v1")]
        headers = {"Authorization": f"Bearer {side.api_key}"} if side.api_key else {}
        try:
            async with self.slots:
                response = await self.http.get(root + "/metrics", headers=headers)
            families = list(text_string_to_metric_families(response.text)) if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return None
        totals = {"draft": 0.0, "accepted": 0.0}
        seen = False
        for family in families:
            for sample in family.samples:
                for key in totals:
                    if sample.name.endswith(f"spec_decode_num_{key}_tokens_total"):
                        if not math.isfinite(sample.value) or sample.value < 0:
                            return None  # a broken counter is no evidence (and must not end a finished run)
                        totals[key] += sample.value
                        seen = True
        return (totals["draft"], totals["accepted"]) if seen else None

    async def complete(self, side: Side, request: dict, chat: bool) -> Answer:
        """One completion (chat or text) of `request` with the side's model and body fields."""
        body = merge({"model": side.model, **request}, side.body)
        doc = await self._send(side, "POST", "/chat/completions" if chat else "/completions", body)
        return parse_answer(doc, chat, f"{side.url}{'/chat/completions' if chat else '/completions'}")

    async def _send(self, side: Side, method: str, path: str, body: dict | None) -> Any:
        url = side.url + path
        headers = {"Authorization": f"Bearer {side.api_key}"} if side.api_key else {}
        for attempt in range(1, self.retries + 1):
            last = attempt == self.retries
            async with self.slots:
                try:
                    async with asyncio.timeout(self.timeout):  # httpx's timeout is per read: a trickle resets it
                        response = await self.http.request(method, url, json=body, headers=headers)
                except (httpx.TimeoutException, TimeoutError):
                    if last:
                        raise EndpointError(f"{url}: no answer within {self.timeout:g} s ({self.retries} tries): the "
                                            f"server is too slow or stuck; raise --timeout or lower "
                                            f"--concurrency") from None
                    wait = None
                except httpx.TransportError as exc:
                    if side.url not in self.answered:
                        raise EndpointError(_unreachable(side.url, exc)) from None
                    if last:
                        raise EndpointError(f"{url}: the server went away mid-run ({_reason(exc)}, {self.retries} "
                                            f"tries)") from None
                    wait = None
                else:
                    self.answered.add(side.url)
                    if response.status_code not in (429, 502, 503, 504) or last:
                        return _read(response, url, side, body, self.retries)
                    wait = retry_after(response.headers.get("retry-after"))
            self.retried += 1
            if wait is not None and wait > self.max_wait:
                self.notes.add(f"{side.url} asked to wait {wait:.0f} s (Retry-After) before a retry; the audit waited "
                               f"{self.max_wait:.0f} s")
            await asyncio.sleep(min(self.max_wait, wait if wait is not None else 2 ** (attempt - 1)))
        raise AssertionError("unreachable")


def retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _read(response: httpx.Response, url: str, side: Side, body: dict | None, retries: int) -> Any:
    status = response.status_code
    kind = response.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    try:
        doc = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        doc = None
    except RecursionError:
        raise EndpointError(f"{url} answered JSON nested too deep to read: is {side.url} an OpenAI-compatible "
                            f"API?") from None
    if status == 200:
        if doc is None:
            what = "an HTML page" if "html" in kind else f"{kind}"
            raise EndpointError(f"{url} answered {what}, not JSON: is {side.url} the base URL of an "
                                f"OpenAI-compatible API (such as http://host:8000/v1)?")
        return doc
    message = _message(doc, response.text)
    if 300 <= status < 400:
        where = response.headers.get("location")
        raise EndpointError(f"{url} redirects ({status}) to {where}: give that address as "
                            f"{'--server' if side.name == 'endpoint' else '--reference'}" if where else
                            f"{url} answered a redirect ({status}) without saying where (no Location header): is "
                            f"{side.url} the API's address?")
    if status in (401, 403):
        raise EndpointError(f"{url} refused the API key ({status}: {message}): {KEY_FIX}")
    if status == 404 and path_of(url).endswith("/models") and doc is None:
        raise EndpointError(f"{url} is not there (404, {kind}): is {side.url} the base URL of an OpenAI-compatible "
                            f"API (such as http://host:8000/v1)?")
    if status == 404 and body is not None and ("model" in message.lower()):
        raise EndpointError(f"{url}: the server does not serve model {side.model!r} (404: {message}); give "
                            f"{model_option(side)} with one it lists at {side.url}/models")
    if status in (400, 404, 405, 422):
        raise Refused(f"{url} refused the request ({status}: {message})", status)
    if status == 429:
        raise EndpointError(f"{url} kept answering 429 (too many requests) after {retries} tries: lower "
                            f"--concurrency or raise --retries")
    raise EndpointError(f"{url} answered {status}: {message}")


def _message(doc: Any, text: str) -> str:
    """The error's words: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, else the body's start."""
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and error.get("message"):
            return " ".join(str(error["message"]).split())
        if isinstance(error, str):
            return " ".join(error.split())
        if "detail" in doc:
            return " ".join(json.dumps(doc["detail"]).split())[:300] if not isinstance(doc["detail"], str) \
                else " ".join(doc["detail"].split())
    words = " ".join(text.split())
    return (words[:200] + "...") if len(words) > 200 else words or "no message"


def model_option(side: Side) -> str:
    """The option that names this side's model."""
    return "--model" if side.name == "endpoint" else "--reference-model"


def path_of(url: str) -> str:
    return urlsplit(url).path


def _unreachable(url: str, exc: httpx.TransportError) -> str:
    return (f"cannot reach {url} ({_reason(exc)}): is the server running, and is this its address? "
            f"(check --server / --reference)")


def _reason(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        cause: BaseException | None = exc
        while cause is not None:  # httpx says "All connection attempts failed"; the OS error below says why
            if isinstance(cause, OSError) and (cause.errno or cause.strerror):
                return (os.strerror(cause.errno) if cause.errno else cause.strerror).lower()
            if isinstance(cause, ExceptionGroup) and cause.exceptions:
                cause = cause.exceptions[0]
                continue
            cause = cause.__cause__ or cause.__context__
        return str(exc) or "cannot connect"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "it closed the connection without an HTTP answer"
    if isinstance(exc, (httpx.ReadError, httpx.WriteError)):
        return "the connection broke"
    return str(exc) or type(exc).__name__


def parse_answer(doc: Any, chat: bool, url: str) -> Answer:
    """An Answer from a completion's JSON: its text, finish reason, tokens and logprobs where given (OpenAI's
    legacy completions shape, the chat shape, and llama-server's post-sampling probabilities)."""
    try:
        choice = doc["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
    except (KeyError, IndexError, TypeError):
        raise EndpointError(f"{url} answered JSON that is not a completion (no choices[0]."
                            f"{'message.content' if chat else 'text'}): is this an OpenAI-compatible API?") from None
    finish = choice.get("finish_reason")
    for what, value in (("message.content" if chat else "text", text), ("finish_reason", finish)):
        if value is not None and not isinstance(value, str):
            raise EndpointError(f"{url} answered a completion whose choices[0].{what} is a JSON {type_name(value)}, "
                                f"not a string: is this an OpenAI-compatible API?")
    usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else {}
    spec = usage.get("specdecode") if isinstance(usage.get("specdecode"), dict) else {}
    tokens, top = _logprobs(choice.get("logprobs"))
    return Answer(text or "", finish, _int(usage.get("completion_tokens")), tokens, top,
                  _int(spec.get("drafted")), _int(spec.get("accepted")))


def type_name(value: Any) -> str:
    """JSON's name for a value's type (what a server sent where a string belonged)."""
    return {dict: "object", list: "array", bool: "boolean", int: "number", float: "number"}.get(type(value), "value")


def _logprobs(lp: Any) -> tuple[tuple[str, ...] | None, tuple[dict[str, float], ...] | None]:
    if not isinstance(lp, dict):
        return None, None
    if isinstance(lp.get("tokens"), list):  # completions, OpenAI's legacy shape
        tops = lp.get("top_logprobs")
        top = tuple(_top_dict(t) for t in tops) if isinstance(tops, list) and len(tops) == len(lp["tokens"]) else None
        return tuple(str(t) for t in lp["tokens"]), top
    content = lp.get("content")
    if isinstance(content, list):  # chat's shape (llama-server uses it for completions too)
        tokens = tuple(str(c.get("token", "")) for c in content if isinstance(c, dict))
        if len(tokens) != len(content):
            return None, None
        tops = [c.get("top_logprobs", c.get("top_probs")) for c in content]
        top = tuple(_top_list(t) for t in tops) if all(isinstance(t, list) for t in tops) else None
        return tokens, top
    return None, None


def _top_dict(entry: Any) -> dict[str, float]:
    if not isinstance(entry, dict):
        return {}
    return {str(k): lp for k, v in entry.items() if (lp := _logprob(v)) is not None}


def _top_list(entries: list) -> dict[str, float]:
    """[{"token", "logprob"}] or llama-server's [{"token", "prob"}], as text -> logprob; tokens of the same
    text (two ids that print alike) add up."""
    probs: dict[str, float] = {}
    for e in entries:
        if not isinstance(e, dict) or "token" not in e:
            continue
        lp = _logprob(e.get("logprob"))
        p = math.exp(lp) if lp is not None else min(1.0, e["prob"]) if _finite(e.get("prob")) and e["prob"] >= 0 \
            else None
        if p is not None:
            probs[str(e["token"])] = probs.get(str(e["token"]), 0.0) + p
    return {token: math.log(p) for token, p in probs.items() if p > 0}


def _logprob(v: Any) -> float | None:
    """A reported log-probability: a finite number, above 0 only by rounding (a server that reports more is
    capped at 0, probability 1, rather than overflow the one-sample test); None if not a number."""
    return min(0.0, float(v)) if _finite(v) else None


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None
