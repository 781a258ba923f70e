"""Adaptive K's costs are measured once per machine/model/backend/drafter and kept in the cache directory,
so a second process skips the calibration and a seed gives the same sample in both."""

import json

import pytest

from specdecode.core.probs import SamplingParams
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.engine.calibration import CalibrationStore, calibration_key
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.policy import AdaptiveK
from tests.tiny import CHARS, SPECIALS, char_tokenizer, tiny_pair

VOCAB = len(SPECIALS) + len(CHARS)
SAMPLED = GenerationConfig(max_new_tokens=40, sampling=SamplingParams(temperature=1.0), k=None, seed=11)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=VOCAB, seed=4, noise=0.1, scale=0.3)


def make(pair, store, recalibrate=False):
    target, draft = pair
    return SpeculativeDecoder(target, char_tokenizer(), [LookupDrafter(), ModelDrafter(draft)], eos_ids=[0],
                              policy=AdaptiveK(), calibration=store, recalibrate=recalibrate)


class CountingPolicy(AdaptiveK):
    calibrations = 0

    def calibrate(self, time_pass, time_step, time_catchup=None):
        CountingPolicy.calibrations += 1
        super().calibrate(time_pass, time_step, time_catchup)


def test_first_decoder_measures_and_saves(pair, tmp_path):
    store = CalibrationStore(tmp_path)
    first = make(pair, store)
    first.generate("def f(x):", SAMPLED)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["key"] == calibration_key(first.target, first.drafters)
    assert set(saved["costs"]["t_step"]) == {"lookup", "model"} and len(saved["costs"]["t_verify"]) == first.policy.k_max + 1
    assert set(saved["costs"]["t_catchup"]) == {"model"}  # only a stateful drafter can fall behind


def test_second_decoder_reads_the_costs_and_reproduces_the_sample(pair, tmp_path):
    store = CalibrationStore(tmp_path)
    # costs under which drafting pays (a flat pass, a cheap draft), as a machine would have measured them
    key = calibration_key(make(pair, store).target, make(pair, store).drafters)
    sizes = range(1, make(pair, store).policy.k_max + 2)
    store.save(key, {"t_verify": {str(n): 0.01 for n in sizes}, "t_step": {"lookup": 1e-5, "model": 1e-3}})
    samples = []
    for _ in range(2):  # two processes would start like this: an empty policy, the same cache
        decoder = make(pair, store)
        decoder.policy.__class__ = CountingPolicy
        CountingPolicy.calibrations = 0
        out = decoder.generate("def f(x):", SAMPLED)
        assert CountingPolicy.calibrations == 0  # read from the file, not measured
        assert decoder.policy.t_verify[1] == 0.01
        assert max(r.drafted for r in out.stats.rounds) >= 2  # K follows the loaded costs
        samples.append(out.tokens)
    assert samples[0] == samples[1]  # same costs + per-request acceptance state: same K, same sample


def test_recalibrate_measures_and_rewrites(pair, tmp_path):
    store = CalibrationStore(tmp_path)
    make(pair, store).generate("x = 1", SAMPLED)
    decoder = make(pair, store, recalibrate=True)
    decoder.policy.__class__ = CountingPolicy
    CountingPolicy.calibrations = 0
    decoder.generate("x = 1", SAMPLED)
    decoder.generate("x = 2", SAMPLED)
    assert CountingPolicy.calibrations == 1  # once, not per request


def test_key_separates_models_and_drafters(pair):
    target, draft = pair
    with_model = calibration_key(target, [LookupDrafter(), ModelDrafter(draft)])
    lookup_only = calibration_key(target, [LookupDrafter()])
    swapped = calibration_key(draft, [LookupDrafter(), ModelDrafter(target)])
    assert len({with_model, lookup_only, swapped}) == 3


def test_unreadable_or_foreign_files_are_ignored(pair, tmp_path):
    store = CalibrationStore(tmp_path)
    key = "machine | model"
    store.path(key).write_text("not json")
    assert store.load(key) is None
    store.path(key).write_text(json.dumps({"key": "another key", "costs": {"t_verify": {}, "t_step": {}}}))
    assert store.load(key) is None  # a hash collision or an edited file never feeds wrong costs
    store.save(key, {"t_verify": {"1": 0.1}, "t_step": {"lookup": 0.0}})
    assert store.load(key) == {"t_verify": {"1": 0.1}, "t_step": {"lookup": 0.0}}


def test_unwritable_directory_only_costs_a_recalibration(pair, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = CalibrationStore(blocker / "calibration")  # cannot be created
    out = make(pair, store).generate("def g():", SAMPLED)
    assert len(out.tokens) > 0


def test_a_rounds_cost_includes_the_work_on_its_logits(pair, monkeypatch):
    """Calibration times a round as the loop pays for it: the pass, then the probabilities and a
    plain step's sample (1 token) or the verification of its drafts (n tokens); the cache is left as
    it was. The kernel-only timing (no params, for the frontier benchmark) does neither."""
    from specdecode.engine import calibration, verification
    from specdecode.engine.slot import prefill

    target, _ = pair
    calls: list[tuple[str, int]] = []
    real_verify, real_sample = calibration.verify, verification.sample_token
    monkeypatch.setattr(calibration, "verify",
                        lambda d, q, p, r: calls.append(("verify", d.shape[1])) or real_verify(d, q, p, r))
    monkeypatch.setattr(verification, "sample_token", lambda *a: calls.append(("sample", 1)) or real_sample(*a))
    prefill(target, [], [5, 6, 7, 8])
    length = target.length
    for n in (1, 4):
        assert calibration.time_pass(target, 8, n, SamplingParams(temperature=0.7)) > 0
        assert target.length == length
    assert calls == [("sample", 1), ("verify", 3)]
    calls.clear()
    calibration.time_pass(target, 8, 4)
    assert calls == [] and target.length == length


def test_costs_measured_under_another_version_are_measured_anew(pair, tmp_path):
    """A cost file under the key before COSTS_VERSION (pass-only timings, no version in the key) or
    under another version is not read."""
    from specdecode.engine import calibration

    target, draft = pair
    drafters = [LookupDrafter(), ModelDrafter(draft)]
    key = calibration_key(target, drafters)
    assert key.startswith(f"costs v{calibration.COSTS_VERSION} | ")
    store = CalibrationStore(tmp_path)
    version = calibration.COSTS_VERSION
    for old in (key.split(" | ", 1)[1], key.replace(f"v{version} ", f"v{version - 1} ")):
        assert old != key
        store.save(old, {"t_verify": {"1": 1.0}, "t_step": {}})
        assert store.load(key) is None and store.load(old) is not None


GOOD_COSTS = {"t_verify": {"1": 0.01, "2": 0.012}, "t_step": {"lookup": 0.0, "model": 1e-3},
              "t_catchup": {"model": 1e-4}}
MALFORMED = {  # what a hand edit or a half-written disk leaves; each is measured anew, never fed to the policy
    "a list": [],
    "costs a string": {"costs": "x"},
    "t_verify a string": {"costs": {**GOOD_COSTS, "t_verify": "x"}},
    "no t_step": {"costs": {"t_verify": GOOD_COSTS["t_verify"]}},
    "no t_verify": {"costs": {"t_step": GOOD_COSTS["t_step"]}},
    "a negative pass time": {"costs": {**GOOD_COSTS, "t_verify": {"1": -0.01}}},
    "a zero pass time": {"costs": {**GOOD_COSTS, "t_verify": {"1": 0}}},
    "a pass size that is not a number": {"costs": {**GOOD_COSTS, "t_verify": {"abc": 0.01}}},
    "pass size 0": {"costs": {**GOOD_COSTS, "t_verify": {"0": 0.01}}},
    "a time that is a string": {"costs": {**GOOD_COSTS, "t_step": {"lookup": "fast"}}},
    "a time that is true": {"costs": {**GOOD_COSTS, "t_step": {"lookup": True}}},
    "a negative step time": {"costs": {**GOOD_COSTS, "t_step": {"lookup": -1.0}}},
    "an infinite time": {"costs": {**GOOD_COSTS, "t_verify": {"1": float("inf")}}},
    "t_catchup a list": {"costs": {**GOOD_COSTS, "t_catchup": [1]}},
}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_file_is_treated_as_absent_and_named(tmp_path, capsys, content):
    store = CalibrationStore(tmp_path)
    key = "machine | model"
    if isinstance(content, dict):
        content = {"key": key, **content}
    store.path(key).write_text(json.dumps(content))
    assert store.load(key) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(store.path(key)) in err and "measuring anew" in err


def test_a_well_formed_file_loads_quietly(tmp_path, capsys):
    store = CalibrationStore(tmp_path)
    store.save("k", GOOD_COSTS)
    assert store.load("k") == GOOD_COSTS and store.load("absent") is None
    assert capsys.readouterr().err == ""


def test_a_malformed_file_is_measured_anew_and_overwritten(pair, tmp_path, capsys):
    """End to end: the decoder's first request measures (no AttributeError, KeyError or a cost model's
    ValueError from the bad file) and replaces the file with costs that load."""
    store = CalibrationStore(tmp_path)
    decoder = make(pair, store)
    key = calibration_key(decoder.target, decoder.drafters)
    store.path(key).write_text(json.dumps({"key": key, "costs": {**GOOD_COSTS, "t_verify": {"1": -1.0}}}))
    decoder.policy.__class__ = CountingPolicy
    CountingPolicy.calibrations = 0
    assert len(decoder.generate("def f(x):", SAMPLED).tokens) > 0
    assert CountingPolicy.calibrations == 1
    assert "ignoring the calibration file" in capsys.readouterr().err
    assert len(store.load(key)["t_verify"]) == decoder.policy.k_max + 1
