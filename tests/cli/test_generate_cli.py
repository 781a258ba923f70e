"""`specdecode generate` on tiny models saved as transformers directories."""

import json

import pytest

from specdecode.cli import main
from tests.tiny import save_pair



@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("models"), seed=11, scale=0.4, noise=0.05, max_len=256)


def gen(capsys, model_dirs, *extra):
    argv = ["generate", "def f(x):", "--target", model_dirs[0], "--draft", model_dirs[1], "--dtype", "float32",
            "--max-new-tokens", "24", *extra]
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code
    out = capsys.readouterr()
    return rc, out


def test_json_spec_and_baseline_agree(capsys, model_dirs):
    rc, out = gen(capsys, model_dirs, "--json", "--compare", "--k", "4", "--drafter", "model")
    assert rc == 0
    doc = json.loads(out.out.strip().splitlines()[-1])
    assert doc["speculative"]
    assert doc["stats"]["new_tokens"] == 24 or doc["stats"]["finish_reason"] == "stop"
    assert doc["stats"]["new_tokens"] == doc["baseline"]["stats"]["new_tokens"]
    assert doc["baseline"]["same_text"] is True
    assert doc["stats"]["rounds"] < doc["baseline"]["stats"]["rounds"]
    assert set(doc["stats"]) >= {"alpha", "c", "mean_acceptance_length", "accepted_per_position",
                                 "predicted_speedup", "t_draft", "t_verify", "tokens_per_second"}


def test_streams_text_and_prints_statistics(capsys, model_dirs):
    rc, out = gen(capsys, model_dirs, "--show-drafts", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert rc == 0
    assert "alpha" in out.err and "mean acceptance length" in out.err
    assert len(out.out.strip()) > 0


def test_adaptive_k_declines_a_draft_as_slow_as_the_target(capsys, model_dirs):
    """Here the draft has the target's size (c ~ 1): speculation cannot pay, so K = 0 nearly always."""
    rc, out = gen(capsys, model_dirs, "--json", "--drafter", "model", "--max-new-tokens", "40")
    doc = json.loads(out.out.strip().splitlines()[-1])
    ks = doc["stats"]["k_per_round"]
    assert rc == 0 and ks.count(0) >= len(ks) - 3  # only occasional exploration rounds


def test_lookup_drafter_loads_no_draft_model(capsys, model_dirs):
    """No --draft: the embedded draft is not loaded either (it would not match this tiny target)."""
    rc = main(["generate", "def f(x):", "--target", model_dirs[0], "--dtype", "float32", "--max-new-tokens", "24",
               "--json", "--drafter", "lookup"])
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and set(doc["stats"]["drafter_per_round"]) <= {"lookup", "none"}


def test_confidence_stop_flag(capsys, model_dirs):
    rc, out = gen(capsys, model_dirs, "--json", "--drafter", "model", "--k", "6", "--draft-confidence", "0.9")
    doc = json.loads(out.out.strip().splitlines()[-1])
    assert rc == 0 and max(doc["stats"]["k_per_round"]) <= 6


def test_no_spec(capsys, model_dirs):
    rc, out = gen(capsys, model_dirs, "--no-spec", "--json")
    doc = json.loads(out.out.strip().splitlines()[-1])
    assert rc == 0 and doc["speculative"] is False and doc["stats"]["drafted"] == 0


@pytest.mark.parametrize("extra, message", [
    (["--k", "0"], "k must be an integer >= 1"),
    (["--temperature", "-1"], "temperature must be"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--draft", "/no/such/dir"], "does not exist"),
    (["--dtype", "int3"], "unknown dtype"),
    (["--draft-confidence", "1.5"], "argument --draft-confidence: must be a number in [0, 1)"),
])
def test_bad_input_is_one_clear_line(capsys, model_dirs, extra, message):
    rc, out = gen(capsys, model_dirs, *extra)
    assert rc == 2 and message in out.err and "Traceback" not in out.err
