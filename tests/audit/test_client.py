"""The black-box audit's HTTP client against servers that answer wrongly (httpx's mock transport): every
malformed answer, broken counter and odd header is one EndpointError line or a note, never a traceback
and never a finished run thrown away."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from specdecode.audit.remote.client import Client, EndpointError, Side, base_url, parse_answer, retry_after
from specdecode.audit.remote.compare import first_token_law

SIDE = Side("endpoint", "http://fake/v1", {}, None, "toy")
REFERENCE = Side("reference", "http://fake/v1", {}, None, "toy")


def served(handler, **client) -> Client:
    return Client(transport=httpx.MockTransport(handler), **client)


def ask(client: Client, side: Side = SIDE):
    async def go():
        try:
            return await client.complete(side, {"prompt": "x", "max_tokens": 1}, chat=False)
        finally:
            await client.close()
    return asyncio.run(go())


@pytest.mark.parametrize("choice,words", [
    ({"text": ["a", "b"], "finish_reason": "length"}, "choices[0].text is a JSON array"),
    ({"text": "a", "finish_reason": {"why": "length"}}, "choices[0].finish_reason is a JSON object"),
    ({"text": 3, "finish_reason": "stop"}, "choices[0].text is a JSON number"),
])
def test_a_completion_of_the_wrong_shape_is_one_line(choice, words):
    with pytest.raises(EndpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_answer({"choices": [choice]}, False, "u")


def test_absurd_logprobs_are_capped_not_overflowed():
    """A logprob of 1e308 overflowed math.exp; above 0 it is capped at 0 (probability 1); non-numbers and
    a top_logprobs that is not a list are dropped."""
    doc = {"choices": [{"text": " a", "finish_reason": "length",
                        "logprobs": {"tokens": [" a"], "top_logprobs": [{" a": 1e308, " b": "x", " c": -1.0}]}}]}
    a = parse_answer(doc, False, "u")
    assert a.top == ({" a": 0.0, " c": -1.0},)
    law = first_token_law([a])
    assert all(math.isfinite(v) for v in law.values())
    chat = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop", "logprobs": {"content": [
        {"token": "hi", "logprob": 800.0, "top_logprobs": [{"token": "hi", "logprob": 800.0},
                                                          {"token": "ho", "prob": 7.0}]}]}}]}
    assert parse_answer(chat, True, "u").top == ({"hi": 0.0, "ho": 0.0},)
    odd = {"choices": [{"text": " a", "finish_reason": "length", "logprobs": {"tokens": [" a"], "top_logprobs": 5}}]}
    assert parse_answer(odd, False, "u").top is None


def test_json_nested_too_deep_is_one_line():
    deep = "[" * 100_000 + "]" * 100_000
    client = served(lambda request: httpx.Response(200, content=deep.encode(),
                                                   headers={"content-type": "application/json"}))
    with pytest.raises(EndpointError, match="nested too deep"):
        ask(client)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-1"])
def test_broken_draft_counters_are_no_evidence(value):
    """NaN or Inf at /metrics ended a finished run (int(nan)); a broken counter now reads as none."""
    page = (f"vllm:spec_decode_num_draft_tokens_total {value}\n"
            f"vllm:spec_decode_num_accepted_tokens_total 3\n")
    client = served(lambda request: httpx.Response(200, text=page))
    assert asyncio.run(client.draft_counters(SIDE)) is None
    good = served(lambda request: httpx.Response(200, text=page.replace(value, "5")))
    assert asyncio.run(good.draft_counters(SIDE)) == (5.0, 3.0)  # the control: a sound page is read


def test_retry_after_reads_seconds_and_dates_and_refuses_infinity():
    assert retry_after("2") == 2.0 and retry_after("-3") == 0.0
    assert retry_after("inf") is None and retry_after("nan") is None and retry_after("soon") is None
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: at once


def test_a_long_retry_after_is_cut_short_with_a_note():
    calls = []

    def handler(request):
        calls.append(1)
        if len(calls) == 1:
            return httpx.Response(429, json={"error": {"message": "busy"}}, headers={"Retry-After": "3600"})
        return httpx.Response(200, json={"choices": [{"text": "a", "finish_reason": "length"}]})

    client = served(handler, max_wait=0.01)
    assert ask(client).text == "a" and client.retried == 1
    assert any("asked to wait 3600 s" in n for n in client.notes)


def test_429s_past_the_retries_name_the_retries_given():
    client = served(lambda r: httpx.Response(429, json={"error": {"message": "busy"}}, headers={"Retry-After": "0"}),
                    retries=2)
    with pytest.raises(EndpointError, match="after 2 tries: lower --concurrency or raise --retries"):
        ask(client)


@pytest.mark.parametrize("headers,words", [
    ({"location": "https://other:8443/v1/completions"}, "redirects \\(302\\) to https://other:8443"),
    ({}, "without saying where"),
])
def test_a_redirect_is_one_line(headers, words):
    client = served(lambda r: httpx.Response(302, headers=headers))
    with pytest.raises(EndpointError, match=words):
        ask(client)


def test_a_model_it_does_not_serve_names_the_sides_option():
    client = served(lambda r: httpx.Response(404, json={"error": {"message": "The model 'x' does not exist"}}))
    with pytest.raises(EndpointError, match="give --reference-model"):
        ask(client, REFERENCE)
    client = served(lambda r: httpx.Response(404, json={"error": {"message": "The model 'x' does not exist"}}))
    with pytest.raises(EndpointError, match="give --model"):
        ask(client, SIDE)


def test_an_answer_that_trickles_forever_times_out():
    """httpx's timeout is per read: a server sending a byte every 0.1 s never hit it. The whole answer
    now has `timeout` seconds."""
    class Trickle(httpx.AsyncByteStream):
        async def __aiter__(self):
            while True:
                await asyncio.sleep(0.05)
                yield b" "

    client = served(lambda r: httpx.Response(200, stream=Trickle(), headers={"content-type": "application/json"}),
                    timeout=0.5, retries=1)
    with pytest.raises(EndpointError, match="no answer within 0.5 s"):
        ask(client)


@pytest.mark.parametrize("text,words", [
    ("", "must be an http(s) URL"),
    ("http://127.0.0.1:99999", "port must be a number from 1 to 65535"),
    ("http://127.0.0.1:abc", "port must be a number from 1 to 65535"),
    ("http://:8000", "has no host name"),
])
def test_bad_urls_are_one_line(text, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        base_url(text, "--server")
    assert base_url("http://127.0.0.1:8000/", "--server") == "http://127.0.0.1:8000/v1"  # the control
