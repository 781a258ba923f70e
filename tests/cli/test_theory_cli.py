"""`specdecode theory | simulate | rand7`: JSON output carries the documents' numbers; bad input is one line."""

import json

import pytest

from specdecode.cli import main


def run_json(capsys, *argv):
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_theory_json(capsys):
    out = run_json(capsys, "theory", "--alpha", "0.7", "--c", "8", "--k", "4", "8")
    speedups = {r["K"]: round(r["speedup"], 2) for r in out["rows"]}
    assert speedups == {4: 1.85, 8: 1.60}
    assert out["optimal_k"]["0.7"] == 4
    assert round(out["break_even_alpha"]["4"], 2) == 0.34


def test_no_break_even_where_even_perfect_drafts_lose(capsys):
    """c < 1 (a draft step dearer than the target's): alpha = 1 still loses, so there is no break-even
    alpha (it was printed as 1, which reads as one)."""
    out = run_json(capsys, "theory", "--alpha", "0.9", "--c", "0.5", "--k", "1", "2")
    assert out["break_even_alpha"] == {"1": None, "2": None}
    assert main(["theory", "--alpha", "0.9", "--c", "0.5", "--k", "1"]) == 0
    assert "never pays" in capsys.readouterr().out


def test_theory_alpha_from_pair(capsys):
    out = run_json(capsys, "theory", "--p", "0.7,0.3", "--q", "0.4,0.6", "--k", "4")
    assert out["pair_alpha"] == pytest.approx(0.7)


def test_theory_tables_render(capsys):
    assert main(["theory", "--k", "4"]) == 0
    out = capsys.readouterr().out
    assert "optimal K" in out and "break-even" in out and "3.36" in out.replace("3.362", "3.36")


def test_theory_repeated_alpha_is_one_row(capsys):
    """K values were de-duplicated but alpha values were not: `--alpha 0.5 0.5` printed every row twice."""
    out = run_json(capsys, "theory", "--alpha", "0.6", "0.5", "0.6", "--k", "2", "2")
    assert [(r["alpha"], r["K"]) for r in out["rows"]] == [(0.6, 2), (0.5, 2)]


def test_simulate_json(capsys):
    out = run_json(capsys, "simulate", "--rounds", "3000", "--k", "3", "--seed", "1")
    assert abs(out["mean_tokens"] - out["expected_tokens"]) < 0.15
    assert out["token_p_value"] > 1e-4


def test_rand7_json(capsys):
    out = run_json(capsys, "rand7", "--n", "20000")
    calls = {m["method"]: m["calls_per_draw"] for m in out["methods"]}
    assert calls["basic"] == pytest.approx(50 / 21, abs=0.05)
    assert calls["recycling"] == pytest.approx(2.2156, abs=0.05)


@pytest.mark.parametrize("argv, message", [
    (["theory", "--alpha", "1.5"], "alpha must be in [0, 1]"),
    (["theory", "--p", "0.5,0.5"], "--p and --q go together"),
    (["theory", "--p", "0.5,0.6", "--q", "0.5,0.5"], "probability vector"),
    (["theory", "--k", "0"], "--k values must be 1..64"),
    (["theory", "--k", "4", "65"], "--k values must be 1..64"),  # was the cost curve's "K <= 64" error
    (["simulate", "--k", "0"], "--k must be 1..64"),
    (["simulate", "--k", "1000000000", "--rounds", "1"], "--k must be 1..64"),  # was 13 GB and a hang
    (["simulate", "--rounds", "0"], "--rounds must be >= 1"),
    (["simulate", "--vocab", "262145"], "--vocab must be 2..262144"),
    # was a 26 GB allocation; now memory is bounded, and work that would take minutes is refused
    (["simulate", "--vocab", "100000", "--rounds", "100000", "--k", "8"], "give --rounds 9544 or fewer"),
    (["rand7", "--n", "0"], "--n must be 1..10000000 (more would run for minutes), got 0"),
    (["rand7", "--n", "99999999999999"], "--n must be 1..10000000 (more would run for minutes), got 99999999999999"),
])
def test_bad_input_is_one_clear_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_too_few_samples_is_no_test_not_a_p_value_of_one(capsys):
    """One round (or three draws) leaves one merged cell: no chi-square test, so no p-value (it printed
    1.000 from "0 cells"); enough samples still give one (test_simulate_json)."""
    out = run_json(capsys, "simulate", "--rounds", "1", "--seed", "1")
    assert out["n_p_value"] is None and out["token_p_value"] is None
    out = run_json(capsys, "rand7", "--n", "3")
    assert [m["uniformity_p_value"] for m in out["methods"]] == [None, None]
    assert main(["simulate", "--rounds", "1"]) == 0
    assert "none: too few samples for the test (raise --rounds)" in " ".join(capsys.readouterr().out.split())
