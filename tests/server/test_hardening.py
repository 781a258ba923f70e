"""Hostile clients: disconnects, huge or malformed bodies, strict fields, shutdown under load, slow sockets.

Like test_server.py, every test talks to a real `specdecode serve` process on loopback.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from tokenizers import normalizers
from transformers import AutoTokenizer

from tests.server.conftest import Server
from tests.tiny import save_pair

# greedy on the 2048-token pair below, "bb" runs 1500 tokens without an end token: a long job (~15 s)
LONG = {"model": "tiny", "prompt": "bb", "max_tokens": 1500, "temperature": 0}


@pytest.fixture(scope="module")
def long_dirs(tmp_path_factory):
    """A pair with a 2048-token context whose tokenizer drops spaces (so "   " is zero tokens)."""
    dirs = save_pair(tmp_path_factory.mktemp("long-models"), seed=41, scale=0.3, noise=0.05, max_len=2048)
    for d in dirs:
        tok = AutoTokenizer.from_pretrained(d)
        tok.backend_tokenizer.normalizer = normalizers.Replace(" ", "")
        tok.save_pretrained(d)
    return dirs


@pytest.fixture(scope="module")
def long_server(long_dirs):
    s = Server(long_dirs, "--drafter", "model", "--queue-size", "4", "--max-body-bytes", "6000000",
               "--keep-alive-seconds", "1")
    yield s
    s.stop()


def post(server, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.url}/v1/{path}", content=content, headers={"content-type": "application/json"},
                      timeout=kw.pop("timeout", 60), **kw)


def assert_error(r: httpx.Response, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, err
    return err


def wait_idle(server, seconds: float = 10) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and (server.metric("specdecode_running_generations") > 0
                                      or server.metric("specdecode_queued_requests") > 0):
        time.sleep(0.05)


# 1. disconnects


def test_non_streaming_disconnect_cancels_within_a_round(server):
    """16 non-streaming clients that give up after 0.3 s: all 16 cancelled, nothing left running, and
    far fewer tokens than even one of them asked for (each stops within a round of its disconnect)."""
    full = post(server, "completions", {"model": "tiny", "prompt": "a", "max_tokens": 440, "temperature": 0})
    full_tokens = full.json()["usage"]["completion_tokens"]
    assert full_tokens >= 400
    cancelled, tokens = server.metric("specdecode_cancelled_total"), server.metric("specdecode_tokens_generated_total")

    def give_up() -> None:
        with pytest.raises(httpx.TimeoutException):
            post(server, "completions", {"model": "tiny", "prompt": "a", "max_tokens": 440, "temperature": 0},
                 timeout=0.3)

    threads = [threading.Thread(target=give_up) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_gone = time.time()
    wait_idle(server, 10)
    assert time.time() - t_gone < 3  # not 16 generations run to the end
    assert server.metric("specdecode_cancelled_total") == cancelled + 16
    assert server.metric("specdecode_tokens_generated_total") - tokens < full_tokens


# 2. completion length


def test_max_completion_tokens_is_honoured_and_conflicts_are_400(server):
    msgs = [{"role": "user", "content": "hello"}]
    r = post(server, "chat/completions", {"model": "tiny", "messages": msgs, "max_completion_tokens": 5,
                                          "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = post(server, "chat/completions", {"model": "tiny", "messages": msgs, "max_completion_tokens": 4,
                                          "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
    assert_error(post(server, "chat/completions", {"model": "tiny", "messages": msgs, "max_completion_tokens": 5,
                                                   "max_tokens": 6}), 400, "max_completion_tokens")
    assert_error(post(server, "chat/completions", {"model": "tiny", "messages": msgs,
                                                   "max_completion_tokens": 10000}), 400, "max_completion_tokens")


def test_chat_without_a_limit_stops_at_the_default(long_server):
    r = post(long_server, "chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "zz"}],
                                               "temperature": 0, "specdecode": {"speculative": False}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 512
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"model": "tiny", "prompt": "x" * 511}, "prompt"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 500}]}, "messages"),
])
def test_prompt_that_fills_the_context_is_a_400_naming_it(server, path, body, param):
    err = assert_error(post(server, path, body), 400, param)
    assert "context of 512 tokens" in err["message"] and "max_new_tokens" not in err["message"]


# 3. size and the event loop


def test_oversized_body_is_a_413(server):
    r = post(server, "completions", json.dumps({"model": "tiny", "prompt": "a" * (5 * 2 ** 20)}))
    err = assert_error(r, 413)
    assert "4194304" in err["message"] and "--max-body-bytes" in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_huge_prompt_does_not_stall_the_event_loop(long_server):
    """A 5 MB prompt (under the raised body limit) is tokenized off the event loop: /health keeps
    answering within 1 s, and the prompt, far over the context, is a clear 400."""
    result = {}

    def big() -> None:
        result["r"] = post(long_server, "completions", {"model": "tiny", "prompt": "ab" * 2_500_000}, timeout=120)

    thread = threading.Thread(target=big)
    thread.start()
    worst = 0.0
    while thread.is_alive():
        t0 = time.time()
        assert httpx.get(long_server.url + "/health", timeout=10).status_code == 200
        worst = max(worst, time.time() - t0)
        time.sleep(0.05)
    thread.join()
    assert worst < 1.0, worst
    err = assert_error(result["r"], 400, "prompt")
    assert "5000000 tokens" in err["message"] and "2048" in err["message"]


# 4. input that used to be a 500 (and 7: strict, unsupported and unknown fields)

BAD = [
    ("completions", {"model": "tiny", "prompt": "ab\ud800cd"}, "prompt"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "ab\ud800cd"}]},
     "messages.0.content"),
    ("completions", {"model": "tiny", "prompt": "a", "seed": 2 ** 63}, "seed"),
    ("completions", {"model": "tiny", "prompt": "a", "seed": -2 ** 63 - 1}, "seed"),
    ("completions", {"model": "tiny", "prompt": "a", "seed": 2 ** 64, "stream": True}, "seed"),
    ("completions", {"model": "tiny", "prompt": "a", "top_k": "x"}, "top_k"),
    ("completions", {"model": "tiny", "prompt": "a", "top_k": 1.5}, "top_k"),
    ("completions", {"model": "tiny", "prompt": "a", "min_p": -1}, "min_p"),
    ("completions", {"model": "tiny", "prompt": "a", "min_p": "x"}, "min_p"),
    ("completions", {"model": "tiny", "prompt": "a", "min_p": 1.5}, "min_p"),
    ("completions", {"model": "tiny", "prompt": "a", "logit_bias": {"5": 10}}, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "a", "echo": True}, "echo"),
    ("completions", {"model": "tiny", "prompt": "a", "best_of": 2}, "best_of"),
    ("completions", {"model": "tiny", "prompt": "a", "suffix": "z"}, "suffix"),
    ("completions", {"model": "tiny", "prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"model": "tiny", "prompt": "a", "logprobs": 2}, "logprobs"),
    # completions' logprobs 0 still asks for the sampled token's logprob (OpenAI, vLLM): not a no-op
    ("completions", {"model": "tiny", "prompt": "a", "logprobs": 0}, "logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "store": True}, "store"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "service_tier": "flex"},
     "service_tier"),
    ("completions", {"model": "tiny", "prompt": "a", "top_k": -2}, "top_k"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                          "response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
     "top_logprobs"),
    ("completions", {"model": "tiny", "prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "a", "max_tokens": True}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "a", "stream": "yes"}, "stream"),
    ("completions", {"model": "tiny", "prompt": "a", "specdecode": {"speculative": "off"}}, "specdecode.speculative"),
    ("completions", {"model": "tiny", "prompt": "a", "temperature": "1"}, "temperature"),
    ("completions", '{"model": "tiny", "prompt": "a", "temperature": NaN}', "temperature"),
    ("completions", '{"model": "tiny", "prompt": "a", "top_p": Infinity}', "top_p"),
    ("completions", '{"model": "tiny", "prompt": "a", "min_p": NaN}', "min_p"),
    ("completions", {"model": "tiny", "prompt": "a", "frobnicate": 1}, "frobnicate"),
    ("completions", {"model": "tiny", "prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens"),
    ("completions", {"model": "tiny", "prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"model": "tiny", "prompt": "a", "seed": -1}, "seed"),
    ("completions", {"model": "tiny", "prompt": "a", "seed": -2 ** 63}, "seed"),
    ("completions", {"model": "tiny", "prompt": "a", "user": 5}, "user"),
    ("completions", {"model": "tiny", "prompt": "a", "user": True}, "user"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "user": {}}, "user"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a", "name": "bob"}]},
     "messages.0.name"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0.content"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": []}]}, "messages.0.content"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages.0.content"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": ["a"]}]}, "messages.0.content"),
    ("completions", {"model": "tiny", "prompt": "a", "specdecode": {"k": 3, "speculative": False}}, "specdecode.k"),
    ("completions", {"model": "tiny", "prompt": "a", "specdecode": {"verification": "block", "speculative": False}},
     "specdecode.verification"),
    ("completions", {"model": "tiny", "prompt": "a", "specdecode": {"verification": "block", "reproducible": True}},
     "specdecode.verification"),
]


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    assert_error(post(server, path, body), 400, param)


def test_json_nan_is_a_400_saying_finite_and_logprobs_says_what_does_nothing(server):
    err = assert_error(post(server, "completions", '{"model": "tiny", "prompt": "a", "temperature": NaN}'), 400,
                       "temperature")
    assert "finite" in err["message"], err  # it said "should be less than or equal to 2"
    err = assert_error(post(server, "chat/completions", {"model": "tiny", "logprobs": True,
                                                         "messages": [{"role": "user", "content": "a"}]}),
                       400, "logprobs")
    assert "false" in err["message"], err  # chat's logprobs is a boolean; it said "only 0 is accepted"


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("field, value", [("temperature", 1e-300), ("temperature", 1.2e-38), ("top_p", 1e-300)])
def test_a_vanishing_temperature_or_top_p_samples_the_greedy_text(server, field, value, speculative):
    """Such values once made p NaN: a 500 that also ended every request batched beside it, or, with no
    draft, a 200 with garbage. As T -> 0 (or top_p -> 0) the law becomes the greedy choice (the tiny
    model has no exact ties), so the text must be greedy decoding's."""
    body = {"model": "tiny", "prompt": "hello world this is", "max_tokens": 12, "seed": 3,
            "specdecode": {"speculative": speculative}}
    greedy = post(server, "completions", {**body, "temperature": 0})
    assert greedy.status_code == 200, greedy.text
    r = post(server, "completions", {**body, field: value, **({"specdecode": {"k": 4}} if speculative else {})})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == greedy.json()["usage"]["completion_tokens"]


def test_unknown_field_is_named(server):
    err = assert_error(post(server, "completions", {"model": "tiny", "prompt": "a", "frobnicate": 1}), 400, "frobnicate")
    assert err["message"] == "frobnicate: unknown field (not supported by this server)"


def test_prompt_of_zero_tokens_is_a_400(long_server):
    assert_error(post(long_server, "completions", {"model": "tiny", "prompt": "   "}), 400, "prompt")


def test_no_op_values_of_unsupported_fields_are_accepted(server):
    r = post(server, "completions", {"model": "tiny", "prompt": "a", "max_tokens": 3, "echo": False, "best_of": 1,
                                     "logit_bias": {}, "presence_penalty": 0, "logprobs": None, "user": "u1"})
    assert r.status_code == 200, r.text
    r = post(server, "chat/completions", {"model": "tiny", "max_tokens": 3, "user": None,
                                          "messages": [{"role": "user", "content": "a", "name": None}]})
    assert r.status_code == 200, r.text
    r = post(server, "chat/completions", {"model": "tiny", "max_tokens": 3, "store": False, "metadata": {},
                                          "parallel_tool_calls": True, "service_tier": "auto", "logprobs": False,
                                          "messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 200, r.text


def test_developer_role_is_system_and_top_k_minus_one_is_off(server):
    """OpenAI's newer "developer" role reads as "system"; vLLM's top_k = -1 means off, as 0 does."""
    def text(path, body):
        r = post(server, path, {"model": "tiny", "max_tokens": 8, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice.get("text", choice.get("message", {}).get("content"))
    system = text("chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                                    {"role": "user", "content": "abc"}]})
    assert text("chat/completions", {"messages": [{"role": "developer", "content": "be brief"},
                                                  {"role": "user", "content": "abc"}]}) == system
    sampled = {"prompt": "hello", "temperature": 0.9, "seed": 11}
    assert text("completions", {**sampled, "top_k": -1}) == text("completions", {**sampled, "top_k": 0})


def test_null_is_the_default_where_openai_allows_null(server):
    """OpenAI's schema has temperature, top_p, n and stream nullable ("unset"); top_k and min_p (vLLM's)
    likewise: null reads as the default, so the seeded sample is the one sent without the fields."""
    base = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "seed": 11}
    nulls = {field: None for field in ("temperature", "top_p", "top_k", "min_p", "n", "stream")}
    texts = []
    for body in (base, {**base, **nulls}):
        r = post(server, "completions", body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("path, body", [
    ("completions", {"model": "gpt-4", "prompt": "a"}),
    ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "a"}]})])
def test_an_unknown_model_is_openais_404_model_not_found(server, path, body):
    err = assert_error(post(server, path, body), 404, "model")
    assert err["code"] == "model_not_found" and "'tiny'" in err["message"]  # names the model served
    err = assert_error(httpx.get(f"{server.url}/v1/models/gpt-4"), 404, "model")
    assert err["code"] == "model_not_found"


def test_a_stream_is_counted_by_how_it_ended(server):
    """/metrics counts a stream when it ends: 200 after [DONE], 499 when its client left first (it counted
    every stream as 200 when it began, failed or not)."""
    labels = {"endpoint": "/v1/completions"}
    ok, gone = server.metric("specdecode_requests_total", status="200", **labels), \
        server.metric("specdecode_requests_total", status="499", **labels)
    body = {"model": "tiny", "prompt": "a", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # the first event, then hang up
    r = post(server, "completions", {**body, "max_tokens": 4})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    deadline = time.time() + 10
    while time.time() < deadline and server.metric("specdecode_requests_total", status="499", **labels) == gone:
        time.sleep(0.05)
    assert server.metric("specdecode_requests_total", status="499", **labels) == gone + 1
    assert server.metric("specdecode_requests_total", status="200", **labels) == ok + 1


def test_text_parts_are_the_text_they_join_to(server):
    """OpenAI's content parts: text parts read as their texts joined by newlines (as vLLM does); an image
    part is a 400 that says only text parts are supported."""
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    parts = post(server, "chat/completions", {**base, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]})
    joined = post(server, "chat/completions", {**base, "messages": [{"role": "user", "content": "ab\ncd"}]})
    assert parts.status_code == joined.status_code == 200, parts.text
    assert parts.json()["choices"] == joined.json()["choices"]
    assert parts.json()["usage"]["prompt_tokens"] == joined.json()["usage"]["prompt_tokens"]
    err = assert_error(post(server, "chat/completions", {**base, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
        400, "messages.0.content")
    assert "part 1 is not a text part (it has type 'image_url'): only parts" in err["message"]


def test_non_string_user_and_message_name_are_rejected_with_the_fix(server):
    err = assert_error(post(server, "completions", {"model": "tiny", "prompt": "a", "user": 5}), 400, "user")
    assert "string" in err["message"]
    err = assert_error(post(server, "chat/completions", {"model": "tiny", "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "a", "name": "bob"}]}), 400, "messages.1.name")
    assert "not supported" in err["message"] and "leave it out" in err["message"]


def test_speculation_only_fields_without_speculation_are_a_400(server):
    """k and verification act on drafts; with speculative: false they would be silently ignored."""
    base = {"model": "tiny", "prompt": "a", "max_tokens": 3}
    err = assert_error(post(server, "completions", {**base, "specdecode": {"k": 3, "speculative": False}}), 400,
                       "specdecode.k")
    assert "drop k or speculative: false" in err["message"]
    err = assert_error(post(server, "completions", {**base, "specdecode": {"verification": "block",
                                                                            "speculative": False}}),
                       400, "specdecode.verification")
    assert "speculative: false" in err["message"]
    # their do-nothing values are fine
    r = post(server, "completions", {**base, "specdecode": {"k": None, "verification": "token", "speculative": False}})
    assert r.status_code == 200, r.text


def test_reproducible_without_speculation_is_meaningful(server):
    """reproducible is not a speculation-only field: plain decoding samples from its noise too, so with it
    the plain text equals the speculative text for the same seed (which ordinary sampling does not promise)."""
    body = {"model": "tiny", "prompt": "q", "max_tokens": 30, "temperature": 1.0, "seed": 11}
    plain = post(server, "completions", {**body, "specdecode": {"reproducible": True, "speculative": False}}).json()
    spec = post(server, "completions", {**body, "specdecode": {"reproducible": True, "k": 3}}).json()
    assert plain["usage"]["specdecode"]["drafted"] == 0 and spec["usage"]["specdecode"]["drafted"] > 0
    assert plain["choices"][0]["text"] == spec["choices"][0]["text"]


# 7. top_k and min_p are honoured


@pytest.mark.parametrize("extra", [{"top_k": 1}, {"min_p": 1.0}])
def test_top_k_and_min_p_change_the_distribution(server, extra):
    """top_k=1 and min_p=1 leave only the most likely token: sampling at T=1 then equals greedy."""
    base = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 30}
    greedy = post(server, "completions", {**base, "temperature": 0}).json()["choices"][0]["text"]
    sampled = post(server, "completions", {**base, "temperature": 1.0, "seed": 3, **extra}).json()
    assert sampled["choices"][0]["text"] == greedy
    plain = post(server, "completions", {**base, "temperature": 1.0, "seed": 3}).json()["choices"][0]["text"]
    assert plain != greedy  # without the filter, T=1 sampling on this flat model wanders off


# 8. seeds


def test_unseeded_sampling_is_random_and_reports_its_seed(server):
    body = {"model": "tiny", "prompt": "q", "max_tokens": 30, "temperature": 1.0}
    a, b = (post(server, "completions", body).json() for _ in range(2))
    seed_a, seed_b = a["usage"]["specdecode"]["seed"], b["usage"]["specdecode"]["seed"]
    assert seed_a != seed_b and a["choices"][0]["text"] != b["choices"][0]["text"]
    assert 0 <= seed_a < 2 ** 63 and 0 <= seed_b < 2 ** 63  # drawn from the range a request may send
    replay = post(server, "completions", {**body, "seed": seed_a}).json()
    assert replay["choices"][0]["text"] == a["choices"][0]["text"]
    assert replay["usage"]["specdecode"]["seed"] == seed_a
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True, "seed": seed_a},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["specdecode"]["seed"] == seed_a
    assert "".join(e["choices"][0]["text"] for e in events) == a["choices"][0]["text"]


def test_seeds_are_0_to_2_63_minus_1(server):
    """torch's generator keeps a seed's low 63 bits: -1 and 2^63 - 1 would sample alike while reported
    differently, so only 0 .. 2^63 - 1 is accepted, and the 400 names the range."""
    body = {"model": "tiny", "prompt": "q", "max_tokens": 5, "temperature": 1.0}
    for seed in (0, 2 ** 63 - 1):
        r = post(server, "completions", {**body, "seed": seed})
        assert r.status_code == 200 and r.json()["usage"]["specdecode"]["seed"] == seed, r.text
    for seed in (-1, 2 ** 63):
        err = assert_error(post(server, "completions", {**body, "seed": seed}), 400, "seed")
        assert "0 to 2**63 - 1" in err["message"], err


# 5. queue slots


def test_clients_that_left_the_queue_free_their_slots(long_server):
    """--queue-size 4: four streaming clients that disconnect while queued leave the queue empty,
    so the next request is served, not a 429."""
    blocker = httpx.stream("POST", long_server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60)
    with blocker as r:
        lines = r.iter_lines()  # kept: a dropped iterator would close the connection
        next(lines)  # the long job is running
        for _ in range(4):
            with httpx.stream("POST", long_server.url + "/v1/completions", json={**LONG, "stream": True},
                              timeout=60) as queued:
                assert queued.status_code == 200  # headers come at once; the job waits behind the blocker
        deadline = time.time() + 5
        while time.time() < deadline and long_server.metric("specdecode_queued_requests") > 0:
            time.sleep(0.05)
        assert long_server.metric("specdecode_queued_requests") == 0
        assert long_server.metric("specdecode_running_generations") == 1  # the blocker still runs
        codes: list[int] = []
        fillers = [threading.Thread(target=lambda: codes.append(
            post(long_server, "completions", {"model": "tiny", "prompt": "a", "max_tokens": 2}).status_code))
            for _ in range(4)]
        for t in fillers:  # the four slots are free again
            t.start()
        deadline = time.time() + 5
        while time.time() < deadline and long_server.metric("specdecode_queued_requests") < 4:
            time.sleep(0.05)
        r5 = post(long_server, "completions", {"model": "tiny", "prompt": "a", "max_tokens": 2})
        assert_error(r5, 429)  # now four live clients are waiting behind the blocker
        assert r5.headers["retry-after"] == "1"
    for t in fillers:  # the blocker hung up: the four are served
        t.join(timeout=30)
    assert codes == [200] * 4
    wait_idle(long_server, 30)


# 9. protocol


def test_framework_errors_are_openai_shaped_and_counted(server):
    before = server.metric("specdecode_requests_total")
    assert_error(httpx.get(server.url + "/nope"), 404)
    r = httpx.get(server.url + "/v1/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"
    assert_error(post(server, "completions", b'{"model": "tiny", "prompt": "\xff"}'), 400)
    assert_error(post(server, "completions", "[" * 100_000), 400)
    assert server.metric("specdecode_requests_total") == before + 4
    err = assert_error(post(server, "completions/", {"model": "tiny", "prompt": "a"}), 404)  # was a bare 307
    assert "/v1/completions/" in err["message"], err


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/tiny", "/metrics"])
def test_read_only_endpoints_answer_head(server, path):
    """Load balancers health-check with HEAD: it was a 405."""
    r = httpx.head(server.url + path, timeout=10)
    assert r.status_code == 200 and r.content == b"", (r.status_code, r.content)
    assert r.headers["content-type"] == httpx.get(server.url + path, timeout=10).headers["content-type"]


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_json_without_a_json_content_type_is_a_400_saying_so(server, content_type):
    """curl -d sends application/x-www-form-urlencoded. We do not parse such bodies as JSON (a browser page
    could then POST them cross-site without a CORS preflight), but the 400 says what to change."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"model": "tiny", "prompt": "a"}),
                   headers=headers, timeout=60)
    err = assert_error(r, 400)
    assert "Content-Type: application/json" in err["message"], err


@pytest.mark.parametrize("body, says", [("", "the request body is empty"),
                                        ("[1]", "must be a JSON object, got an array"),
                                        ("null", "must be a JSON object, got null")])
def test_empty_or_non_object_body_is_a_400_saying_so(server, body, says):
    err = assert_error(post(server, "chat/completions", body), 400)
    assert says in err["message"], err


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_include_usage_sends_a_final_usage_chunk(server, kind):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    args = dict(model="tiny", max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
    if kind == "completion":
        chunks = list(client.completions.create(prompt="abc", **args))
    else:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "abc"}], **args))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
    if kind == "chat":  # OpenAI's last chunk with a choice has an empty delta (it had {"content": ""})
        assert chunks[-2].choices[0].delta.content is None and chunks[-2].choices[0].delta.role is None


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 100\r\n\r\n{\"model\": "],
                         ids=["nothing", "half-a-head", "half-a-body"])
def test_idle_and_half_open_connections_are_closed(long_server, sent):
    """--keep-alive-seconds 1: a client that connects and sends nothing, half a request head, or a head and
    then half its body, is cut off."""
    with socket.create_connection(("127.0.0.1", long_server.port)) as sock:
        sock.sendall(sent)
        sock.settimeout(5)
        t0 = time.time()
        assert sock.recv(100) == b""  # closed by the server
        assert time.time() - t0 < 4


def test_a_slow_body_that_keeps_coming_is_served(long_server):
    """The control: a body sent in pieces 0.4 s apart, 2 s in all (over --keep-alive-seconds 1), is not cut
    off: the clock restarts with each piece of a body."""
    body = json.dumps({"model": "tiny", "prompt": "ab", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", long_server.port)) as sock:
        sock.sendall(head)
        step = len(body) // 5 + 1
        t0 = time.time()
        for i in range(0, len(body), step):
            time.sleep(0.4)
            sock.sendall(body[i:i + step])
        assert time.time() - t0 >= 1.6
        sock.settimeout(60)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


# 6. shutdown


def _events_of(response: httpx.Response, out: list) -> None:
    for line in response.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:])


@pytest.mark.parametrize("signals, drain", [((signal.SIGTERM,), "1"), ((signal.SIGTERM, signal.SIGTERM), "60"),
                                            ((signal.SIGINT, signal.SIGINT), "60")])
def test_shutdown_drains_for_a_bounded_time_then_ends_requests_cleanly(long_dirs, signals, drain):
    """A long stream runs and a non-streaming request waits when the signal comes: after --drain-seconds
    (or at once on a second signal) the stream ends with an error event, the waiting request gets a
    503, and the process exits 0 without a traceback."""
    srv = Server(long_dirs, "--drafter", "model", "--drain-seconds", drain)
    try:
        events: list[str] = []
        waiting: dict = {}
        with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # the stream is running
            queued = threading.Thread(target=lambda: waiting.update(r=post(srv, "completions", LONG)))
            queued.start()
            time.sleep(0.5)
            t0 = time.time()
            for sig in signals:
                srv.proc.send_signal(sig)
                time.sleep(0.3)
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
        queued.join(timeout=30)
        rc = srv.proc.wait(timeout=30)
        took = time.time() - t0
        log = srv.proc.stdout.read()
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert took < 8, took  # ~15 s of queued work was not drained
    assert rc == 0 and "Traceback" not in log, log
    assert "shutting down" in json.loads(events[-1])["error"]["message"]
    err = assert_error(waiting["r"], 503)
    assert "shutting down" in err["message"]
