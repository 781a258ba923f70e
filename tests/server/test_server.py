"""The OpenAI-compatible server, tested over HTTP with the official openai client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from specdecode.core.probs import GREEDY
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from tests.server.conftest import Server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(model_dirs):
    """The same tiny models in-process: what the server's greedy output must equal."""
    return SpeculativeDecoder.load(model_dirs[0], model_dirs[1], drafter="model", dtype="float32", device="cpu",
                                   progress=False)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny") == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError, match="no such model 'org/other'; this server serves 'tiny'"):
        client.models.retrieve("org/other")
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_completion_greedy_equals_engine(client, engine):
    out = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=20, temperature=0)
    expected = engine.generate("def f(x):", GenerationConfig(max_new_tokens=20, sampling=GREEDY, k=None))
    assert out.choices[0].text == expected.text
    assert out.usage.completion_tokens == len(expected.tokens)
    assert out.choices[0].finish_reason in ("length", "stop")
    extra = out.usage.model_extra["specdecode"]
    assert {"rounds", "drafted", "accepted", "alpha", "mean_acceptance_length"} <= set(extra)


def test_chat_completion_greedy_equals_engine(client, engine):
    messages = [{"role": "user", "content": "hello"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    expected = engine.generate(messages, GenerationConfig(max_new_tokens=24, sampling=GREEDY, k=None))
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].message.role == "assistant"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_text_equals_non_streamed(client, kind):
    args = dict(model="tiny", max_tokens=30, temperature=0.8, top_p=0.9, seed=7)
    if kind == "completion":
        full = client.completions.create(prompt="abc", **args).choices[0].text
        parts = [c.choices[0].text for c in client.completions.create(prompt="abc", stream=True, **args)]
    else:
        msgs = [{"role": "user", "content": "abc"}]
        full = client.chat.completions.create(messages=msgs, **args).choices[0].message.content
        parts = [c.choices[0].delta.content or "" for c in
                 client.chat.completions.create(messages=msgs, stream=True, **args)]
    assert "".join(parts) == full and len(parts) > 1


def test_extension_field_changes_k_or_disables_speculation(client):
    plain = client.completions.create(model="tiny", prompt="xyz", max_tokens=20, temperature=0,
                                      extra_body={"specdecode": {"speculative": False}})
    assert plain.usage.model_extra["specdecode"]["drafted"] == 0
    k2 = client.completions.create(model="tiny", prompt="xyz", max_tokens=20, temperature=0,
                                   extra_body={"specdecode": {"k": 2}})
    assert k2.choices[0].text == plain.choices[0].text  # greedy: identical either way
    assert 0 < k2.usage.model_extra["specdecode"]["drafted"] <= 2 * k2.usage.model_extra["specdecode"]["rounds"]


def test_stop_strings(client):
    full = client.completions.create(model="tiny", prompt="q", max_tokens=30, temperature=0).choices[0].text
    stop = full[8:10]
    out = client.completions.create(model="tiny", prompt="q", max_tokens=30, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.find(stop)] and out.choices[0].finish_reason == "stop"


BAD = [
    ("completions", "{not json", None),
    ("completions", {"model": "tiny", "prompt": 5}, "prompt"),
    ("completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "a", "max_tokens": 100000}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "a", "temperature": -1}, "temperature"),
    ("completions", {"model": "tiny", "prompt": "a", "top_p": 0}, "top_p"),
    ("completions", {"model": "tiny", "prompt": "a", "top_p": 1.5}, "top_p"),
    ("completions", {"model": "tiny", "prompt": "a", "n": 2}, "n"),
    ("completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("completions", {"prompt": "a"}, "model"),
    ("chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
    ("completions", {"model": "tiny", "prompt": "a", "specdecode": {"k": 0}}, "specdecode.k"),
]


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/{path}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_metrics_move_and_parse(server, client):
    before = server.metric("specdecode_tokens_generated_total")
    requests_before = server.metric("specdecode_requests_total")
    client.completions.create(model="tiny", prompt="m", max_tokens=10, temperature=0)
    assert server.metric("specdecode_tokens_generated_total") == before + 10
    assert server.metric("specdecode_requests_total") == requests_before + 1
    assert server.metric("specdecode_rounds_total") > 0
    assert server.metric("specdecode_mean_acceptance_length") >= 1.0


def test_concurrent_streaming_load_and_disconnects(server, engine):
    """8 streaming clients x 3 requests on loopback (bounded in count and time): zero errors,
    every greedy output correct; then clients that disconnect mid-stream leave nothing running."""
    expected = {p: engine.generate(p, GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=None)).text
                for p in ("a", "bb", "ccc")}
    errors: list[str] = []

    def worker(i: int) -> None:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        for prompt in ("a", "bb", "ccc"):
            try:
                stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                   stream=True)
                text = "".join(c.choices[0].text for c in stream)
                if text != expected[prompt]:
                    errors.append(f"client {i} prompt {prompt!r}: wrong text")
            except Exception as exc:  # noqa: BLE001 - every failure is a test failure, collected
                errors.append(f"client {i}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert time.time() - t0 < 240

    cancelled_before = server.metric("specdecode_cancelled_total")
    for _ in range(3):
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "zz", "max_tokens": 400, "temperature": 0,
                                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk received: hang up mid-stream
    deadline = time.time() + 30
    while time.time() < deadline and (server.metric("specdecode_running_generations") > 0
                                      or server.metric("specdecode_queued_requests") > 0):
        time.sleep(0.1)
    assert server.metric("specdecode_running_generations") == 0
    assert server.metric("specdecode_cancelled_total") >= cancelled_before + 1
    assert server.metric("specdecode_tokens_generated_total") > 0


def test_bounded_queue_answers_429(model_dirs):
    """With room for one waiting request, a burst of slow requests gets clear 429s, and the server lives on."""
    busy = Server(model_dirs, "--queue-size", "1", "--drafter", "model")
    try:
        codes: list[int] = []
        bodies: list[dict] = []

        def hit() -> None:
            r = httpx.post(busy.url + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": "slow", "max_tokens": 300, "temperature": 0})
            codes.append(r.status_code)
            bodies.append(r.json())

        threads = [threading.Thread(target=hit) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}
        rejected = [b for b, c in zip(bodies, codes) if c == 429]
        assert "busy" in rejected[0]["error"]["message"]
        assert httpx.get(busy.url + "/health").status_code == 200
    finally:
        busy.stop()


def test_continuous_batching_load(model_dirs, engine):
    """--max-batch 3: 32 streaming clients x 5 requests (bounded) through three slots, some
    hanging up mid-stream: zero errors, every greedy output equal to the engine's alone, rounds
    that held several sequences, and nothing left running."""
    batched = Server(model_dirs, "--drafter", "model", "--max-batch", "3", "--queue-size", "64")
    prompts = ("a", "bb", "ccc", "dddd", "e")
    expected = {p: engine.generate(p, GenerationConfig(max_new_tokens=24, sampling=GREEDY, k=None)).text
                for p in prompts}
    errors: list[str] = []

    def worker(i: int) -> None:
        client = openai.OpenAI(base_url=batched.url + "/v1", api_key="x", max_retries=0, timeout=240)
        for j, prompt in enumerate(prompts):
            try:
                stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                   stream=True)
                if (i + j) % 7 == 0:  # this client hangs up after its first chunk
                    next(iter(stream))
                    stream.close()
                    continue
                text = "".join(c.choices[0].text for c in stream)
                if text != expected[prompt]:
                    errors.append(f"client {i} prompt {prompt!r}: {text!r} != {expected[prompt]!r}")
            except Exception as exc:  # noqa: BLE001 - every failure is a test failure, collected
                errors.append(f"client {i}: {exc!r}")

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=400)
        assert not errors, errors[:5]
        assert not any(t.is_alive() for t in threads)
        deadline = time.time() + 30
        while time.time() < deadline and batched.metric("specdecode_running_generations") > 0:
            time.sleep(0.1)
        assert batched.metric("specdecode_running_generations") == 0
        assert batched.metric("specdecode_queued_requests") == 0
        # several sequences per round: the mean batch size is above one
        assert batched.metric("specdecode_batch_size_sum") > 1.5 * batched.metric("specdecode_batch_size_count")
        assert batched.metric("specdecode_time_to_first_token_seconds_count") >= 32 * 5 - 32
        assert batched.metric("specdecode_cancelled_total") >= 1
    finally:
        batched.stop()


def test_a_long_prompt_runs_in_pieces_beside_a_stream(model_dirs, engine):
    """--prefill-chunk 6: a long prompt (288 tokens) that arrives while a stream runs is computed in
    pieces, so no pass holds more than 6 prompt tokens beside the rows (at most 2 x 9 with drafts):
    every pass is within the histogram's 32-token bucket, where the whole prompt in one pass would
    not be. Both outputs equal the engine's alone."""
    server = Server(model_dirs, "--drafter", "model", "--max-batch", "2", "--prefill-chunk", "6")
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=None)
    short, long_ = "abc", "the cat sat on the mat. " * 12
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=240)
        stream = iter(client.completions.create(model="tiny", prompt=short, max_tokens=40, temperature=0,
                                                stream=True))
        text = next(stream).choices[0].text  # the stream runs
        got = client.completions.create(model="tiny", prompt=long_, max_tokens=40, temperature=0)
        text += "".join(c.choices[0].text for c in stream)
        assert text == engine.generate(short, config).text
        assert got.choices[0].text == engine.generate(long_, config).text
        passes = server.metric("specdecode_pass_tokens_count")
        assert passes > 288 / 6 and server.metric("specdecode_pass_tokens_bucket", le="32.0") == passes
        # the prompt's pieces rode beside the stream's row: passes of two sequences
        assert server.metric("specdecode_batch_size_bucket", le="1.0") < server.metric("specdecode_batch_size_count")
    finally:
        server.stop()
