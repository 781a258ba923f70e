"""benchmarks/lookup_bound.py's replay: adaptive K priced on a recorded greedy output must follow that
output exactly (the engine's loop, drafter and policy against a target that answers with it)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "lookup_bound", Path(__file__).resolve().parents[2] / "benchmarks" / "lookup_bound.py")
lookup_bound = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lookup_bound)

# a cheap verification curve (each extra token a tenth of a step): copying pays
CURVE = {n: 1.0 + 0.1 * (n - 1) for n in range(1, 18)}
COSTS = {"t_verify": {str(n): t for n, t in CURVE.items()}, "t_step": {"lookup": 0.0}}
PROMPT = list(range(100, 140)) + [1]
OUTPUT = list(range(100, 130)) + [5, 6, 7, 8]  # the prompt copied, then new text


def test_the_replay_follows_the_output_and_prices_its_rounds():
    replayed = lookup_bound.policy_replay(PROMPT, OUTPUT, COSTS)
    assert max(replayed["ks"]) >= 8  # it drafted long on the copy: the test exercises drafting
    oracle = lookup_bound.replay(PROMPT, OUTPUT, CURVE, k_max=16)
    assert oracle["t_oracle"] <= replayed["t_policy"] < oracle["t_plain"]  # paid, and no better than hindsight


def test_a_target_that_leaves_the_recording_is_caught():
    """Control: a replay target answering one position late is not the recorded output; the replay says so."""
    class Late(lookup_bound.ReplayTarget):
        def __init__(self, script):
            super().__init__([script[0]] + script)

    original = lookup_bound.ReplayTarget
    lookup_bound.ReplayTarget = Late
    try:
        with pytest.raises(AssertionError, match="left the recorded output"):
            lookup_bound.policy_replay(PROMPT, OUTPUT, COSTS)
    finally:
        lookup_bound.ReplayTarget = original
