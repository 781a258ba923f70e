"""`specdecode audit --server URL` against fake OpenAI-compatible servers on loopback ports
(tests/audit/fake_openai.py): verdicts and exit statuses, and every hostile server in one line.

The audits run at the overall false-failure probability 1e-3; the fakes' randomness is a function of
each request, so the outcomes are deterministic.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from specdecode.cli import main
from tests.audit.fake_openai import Served, fake_app, free_port

OFF = '{"specdecode": {"speculative": false}}'


@pytest.fixture(scope="module")
def exact():
    with Served(fake_app("exact")) as served:
        yield served.url


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(["audit", *argv])
    except SystemExit as exc:  # argparse's usage errors (one line: cli.main.Parser)
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_line_error(err: str, *words: str) -> None:
    """stderr is the progress bar (its redrawn lines) and one error line."""
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith("audit:")]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err and all(w in err for w in words), err


def test_quick_passes_a_lossless_server_with_the_control_detected(capsys, exact):
    rc, out, _ = run(capsys, "--server", exact, "--reference-body", OFF, "--quick", "--json")
    doc = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and doc["verdict"] == "pass" and doc["control_detected"] is True, doc["advice"]
    assert doc["samples"] == 200 and all(c["samples"][0] == 200 for c in doc["comparisons"] if c["test"] != "logprobs")
    assert doc["reference"]["body"] == {"specdecode": {"speculative": False}} and doc["endpoint"]["model"] == "toy"


def test_quick_fails_a_lossy_server(capsys):
    with Served(fake_app("accept-all")) as served:
        rc, out, _ = run(capsys, "--server", served.url, "--reference-body", OFF, "--quick")
    assert rc == 1 and "FAIL" in out and "overall: FAIL" in " ".join(out.split())


def test_tables_and_our_servers_bodies_found_by_the_audit(capsys):
    """A server that says it is ours (owned_by specdecode): the reference turns speculation off and the
    endpoint pins K, without being told."""
    with Served(fake_app("exact", owner="specdecode")) as served:
        rc, out, _ = run(capsys, "--server", served.url, "--quick", "--samples", "60", "--greedy-tokens", "4")
    text = " ".join(out.split())
    assert '"speculative": false' in text and '"k": 2' in text
    assert "negative control" in text and "greedy identity" in text and "detectable TV" in text
    assert rc in (0, 3) and ("overall: PASS" in text or "overall: INCONCLUSIVE" in text)


def test_a_server_that_is_not_ours_needs_a_reference(capsys, exact):
    rc, _, err = run(capsys, "--server", exact, "--quick")
    assert rc == 2
    one_line_error(err, "not a specdecode server", "--reference")


def test_nothing_listening(capsys):
    rc, _, err = run(capsys, "--server", f"http://127.0.0.1:{free_port()}", "--reference-body", OFF, "--quick")
    assert rc == 2
    one_line_error(err, "cannot reach", "connection refused")


def test_an_html_page(capsys):
    with Served(fake_app(html=True)) as served:
        rc, _, err = run(capsys, "--server", served.url, "--reference-body", OFF, "--quick")
    assert rc == 2
    one_line_error(err, "HTML page, not JSON", "base URL")


def test_a_server_that_drops_connections(capsys):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def drop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    try:
        rc, _, err = run(capsys, "--server", f"http://127.0.0.1:{port}", "--reference-body", OFF, "--quick")
    finally:
        listener.close()
    assert rc == 2
    one_line_error(err, "closed the connection without an HTTP answer")


def test_a_slow_server(capsys):
    with Served(fake_app(delay=2.0)) as served:
        rc, _, err = run(capsys, "--server", served.url, "--reference-body", OFF, "--quick", "--timeout", "0.3",
                         "--retries", "2")
    assert rc == 2
    one_line_error(err, "no answer within 0.3 s", "--timeout")


def test_a_refused_key(capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    with Served(fake_app(api_key="right")) as served:
        rc, _, err = run(capsys, "--server", served.url, "--reference-body", OFF, "--quick")
        assert rc == 2
        one_line_error(err, "refused the API key (401", "--api-key")
        rc, out, _ = run(capsys, "--server", served.url, "--reference-body", OFF, "--quick", "--api-key", "right",
                         "--samples", "30", "--greedy-tokens", "2", "--json")
    assert json.loads(out.strip().splitlines()[-1])["requests"]["answered"] > 60


def test_429s_are_retried_after_retry_after(capsys):
    with Served(fake_app(busy=3)) as served:
        rc, out, _ = run(capsys, "--server", served.url, "--reference-body", OFF, "--quick", "--samples", "30",
                         "--greedy-tokens", "2", "--json")
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["requests"]["retried"] >= 3 and rc in (0, 3) and not doc["failed"]


def test_a_refused_field_skips_its_settings(capsys):
    with Served(fake_app(refuse=frozenset({"top_k"}))) as served:
        rc, out, _ = run(capsys, "--server", served.url, "--reference-body", OFF, "--samples", "30",
                         "--greedy-tokens", "2", "--setting", "temperature=1", "--setting", "temperature=1,top_k=20",
                         "--boundary-tokens", "0", "--json")
    doc = json.loads(out.strip().splitlines()[-1])
    assert any("top_k refused" in n for n in doc["notes"]) and not doc["failed"]
    assert all("top-k" not in c["group"] for c in doc["comparisons"])


def test_a_server_gone_mid_run(capsys):
    with Served(fake_app(stop_after=60)) as served:
        rc, out, err = run(capsys, "--server", served.url, "--reference-body", OFF, "--quick", "--retries", "2")
    assert rc == 2
    one_line_error(err, "went away mid-run", "requests)")


@pytest.mark.parametrize("argv,words", [
    (["--server", "localhost:8000"], "must be an http(s) URL"),
    (["--server", "http://127.0.0.1:9", "--temperature", "0.5"], "--temperature applies to the in-process audit"),
    (["--reference", "http://127.0.0.1:9"], "--reference applies to the audit of a server"),
    (["--server", "http://127.0.0.1:9", "--body", "{"], "not JSON"),
    (["--server", "http://127.0.0.1:9", "--body", '{"temperature": 2}'], "which the audit sweeps"),
    (["--server", "http://127.0.0.1:9", "--body", "{}", "--reference-body", "{}"], "audits nothing"),
    (["--server", "http://127.0.0.1:9", "--setting", "top_p=0.5"], "give a temperature"),
    # each of these is refused before any request (port 9 has no server: a check after connecting would say so)
    (["--server", ""], "must be an http(s) URL"),
    (["--server", "http://127.0.0.1:99999"], "port must be a number from 1 to 65535"),
    (["--server", "http://127.0.0.1:abc"], "port must be a number from 1 to 65535"),
    (["--server", "http://:8000"], "has no host name"),
    (["--server", "http://127.0.0.1:9", "--reference", ""], "--reference must be an http(s) URL"),
    (["--server", "http://127.0.0.1:9", "--body", '{"a": ' * 5000 + "1" + "}" * 5000], "nested too deep"),
    (["--server", "http://127.0.0.1:9", "--body", '{"a": ' * 40 + "1" + "}" * 40], "nested deeper than 32"),
    (["--server", "http://127.0.0.1:9", "--body", '{"x": NaN}'], "--body: not JSON (NaN is not a JSON value)"),
    (["--server", "http://127.0.0.1:9", "--prompt", "hi"], "give prompts in a JSON file with --prompts FILE"),
    (["--server", "http://127.0.0.1:9", "--temperature", "1"], "--temperature applies to the in-process audit"),
    (["--server", "http://127.0.0.1:9", "--top-p=1"], "--top-p applies to the in-process audit"),
    (["--server", "http://127.0.0.1:9", "--temp", "1"], "--temperature applies to the in-process audit"),
    (["--server", "http://127.0.0.1:9", "--setting", "temperature=0.7,temperature=1"], "gives temperature twice"),
    (["--server", "http://127.0.0.1:9", "--setting", "temperature=1,top_k=1.5"], "top_k must be a whole number"),
    (["--server", "http://127.0.0.1:9", "--setting", "temperature=1", "--setting", "temperature=1.0"],
     "--setting gives the same setting twice"),
    (["--server", "http://127.0.0.1:9", "--max-tokens", "3", "3"], "--max-tokens gives 3 twice"),
    (["--server", "http://127.0.0.1:9", "--model", ""], "--model is empty"),
    (["--server", "http://127.0.0.1:9", "--reference-model", " "], "--reference-model is empty"),
    (["--server", "http://127.0.0.1:9", "--samples", "1000000000"], "from 1 to 100,000"),
    (["--server", "http://127.0.0.1:9", "--samples", "5"], "--samples must be >= 20"),
    (["--server", "http://127.0.0.1:9", "--level", "2"], "--level must be in (0, 0.9)"),
    (["--server", "http://127.0.0.1:9", "--control-factor", "1"], "--control-factor must not be 1"),
    (["--server", "http://127.0.0.1:9", "--api-key", ""], "--api-key is empty"),
    (["--server", "http://127.0.0.1:9", "--api-key", "sk-a b"], "--api-key holds a character"),
    (["--server", "http://127.0.0.1:9", "--api-key", "sk-\u043a\u043b\u044e\u0447"], "--api-key holds a character"),
    (["--server", "http://127.0.0.1:9", "--api-key", "sk-a\nb"], "--api-key holds a character"),
])
def test_bad_options_are_one_line(capsys, argv, words):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    one_line_error(err, words)


def test_a_key_in_the_environment_no_header_can_carry(capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-a\nb")
    rc, _, err = run(capsys, "--server", "http://127.0.0.1:9", "--reference-body", OFF)
    assert rc == 2
    one_line_error(err, "$OPENAI_API_KEY holds a character")


@pytest.mark.parametrize("content,words", [
    (None, "cannot read it"),  # a folder
    ('[{"prompt": "a", "temperature": 0.7}]', "unknown field 'temperature'"),
    ('[{"prompt": "a", "name": "x"}, {"prompt": "b", "name": "x"}]', "the name 'x' is given to more than one"),
    ('[{"prompt": "a", "name": ""}]', "\"name\" must be a non-empty string"),
    ("[" * 5000 + "]" * 5000, "nested too deep"),
    ('[{"prompt": "a", "stop": [NaN]}]', "NaN is not a JSON value"),
])
def test_bad_prompt_files_are_one_line(capsys, tmp_path, content, words):
    path = tmp_path / "prompts"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    rc, _, err = run(capsys, "--server", "http://127.0.0.1:9", "--reference-body", OFF, "--prompts", str(path))
    assert rc == 2
    one_line_error(err, "--prompts", words)


def test_a_reference_model_it_does_not_serve_names_reference_model(capsys, exact):
    rc, _, err = run(capsys, "--server", exact, "--reference-body", OFF, "--reference-model", "nope", "--quick")
    assert rc == 2
    one_line_error(err, "does not serve model 'nope'", "give --reference-model")


def test_in_process_options_at_their_defaults_are_fine_without_server(capsys, monkeypatch):
    """The control of the mode checks: the same options without --server are the in-process audit's own
    (it is stopped here at its first step, loading the models, by a missing file)."""
    rc, _, err = run(capsys, "--temperature", "1", "--top-p", "1", "--target", "/nonexistent/t.gguf")
    assert rc != 0 and "applies to" not in err


def test_an_endpoint_without_draft_counts_gets_a_note(capsys, exact, tmp_path):
    """The fake reports no usage.specdecode and, at one URL, its /metrics cannot say which side drafted: the
    audit says it cannot show the endpoint speculated."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["The colour of the sky is"]))
    rc, out, _ = run(capsys, "--server", exact, "--reference-body", OFF, "--samples", "30", "--greedy-tokens", "0",
                     "--setting", "temperature=1", "--prompts", str(prompts), "--json")
    doc = json.loads(out.strip().splitlines()[-1])
    assert any("cannot show that it speculated" in n for n in doc["notes"]), doc["notes"]
