"""K policies: adaptive K converges to the closed-form optimum on a simulated model."""

from __future__ import annotations

import random

import pytest

from specdecode.core.theory import CostModel, optimal_k
from specdecode.drafters.protocol import Situation
from specdecode.engine.policy import ALONE, AdaptiveK, BatchLoad, FixedK, _DrafterState


def simulate(policy: AdaptiveK, alpha: float, t_step: float, curve, rounds: int, seed: int = 0) -> list[int]:
    """Drive the policy with rounds whose acceptance is geometric(alpha) and costs are known."""
    rng = random.Random(seed)  # an explicit instance: no global RNG
    policy.calibrate(lambda n: curve(n), {"sim": lambda: t_step})
    chosen = []
    for _ in range(rounds):
        k = policy.choose("sim")
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        size = policy.verify_size(k + 1) if k else 1
        policy.observe("sim" if k else "none", k, n, k * t_step, size, curve(size))
        chosen.append(k)
    return chosen


@pytest.mark.parametrize("alpha, c", [(0.9, 10.0), (0.8, 5.0), (0.6, 3.0), (0.7, 8.0), (0.95, 4.0)])
def test_converges_to_closed_form_optimum_flat_cost(alpha, c):
    policy = AdaptiveK(k_max=8, forget=0.995)
    chosen = simulate(policy, alpha, t_step=1 / c, curve=lambda n: 1.0, rounds=3000)
    best = optimal_k(alpha, c, k_max=8)
    tail = chosen[-500:]
    assert max(set(tail), key=tail.count) == best
    # the estimate itself is close to the truth
    assert policy.alpha("sim") == pytest.approx(alpha, abs=0.05)


def test_near_tie_chooses_a_k_within_one_percent():
    """alpha 0.9, c 2.5: K=4 and K=5 differ by 0.8%; either is fine, nothing worse is."""
    from specdecode.core.theory import speedup
    policy = AdaptiveK(k_max=8, forget=0.995)
    chosen = simulate(policy, 0.9, t_step=1 / 2.5, curve=lambda n: 1.0, rounds=3000)
    best = speedup(0.9, 2.5, optimal_k(0.9, 2.5, 8))
    assert all(speedup(0.9, 2.5, k) >= 0.99 * best for k in chosen[-500:])


def test_converges_with_a_growing_cost_curve():
    curve = lambda n: 1.0 + 0.3 * (n - 1)  # verification grows with K
    policy = AdaptiveK(k_max=8, forget=0.995)
    chosen = simulate(policy, 0.85, t_step=0.1, curve=curve, rounds=3000)
    model = CostModel.measured(0.1, [curve(n) for n in range(1, 10)])
    best = model.optimal_k(0.85)
    tail = chosen[-500:]
    assert max(set(tail), key=tail.count) == best
    assert best < optimal_k(0.85, 10.0, 8)  # the curve matters: a flat model would draft more


def test_does_not_speculate_when_it_cannot_pay():
    """alpha 0.1 with a slow draft: K = 0 except for occasional exploration rounds."""
    policy = AdaptiveK(k_max=8, explore_every=16)
    chosen = simulate(policy, 0.1, t_step=0.5, curve=lambda n: 1.0, rounds=400)
    tail = chosen[-200:]
    assert tail.count(0) >= 180 and set(tail) <= {0, 1}


def test_never_explores_a_drafter_that_cannot_pay_even_when_right():
    """llama.cpp on the 2-core CPU: a pass of n tokens costs ~1 + 0.55 (n - 1) steps and the 0.5B draft
    half a step; even at alpha 0.95 drafting loses, so a test round is pure cost: never K > 0."""
    policy = AdaptiveK(k_max=8, explore_every=16)
    steep = lambda n: 1.0 + 0.55 * (n - 1)  # noqa: E731
    chosen = simulate(policy, 0.9, t_step=0.5, curve=steep, rounds=400)
    assert set(chosen) == {0}
    # the same drafter against a flat pass does get explored (and then used: alpha 0.9 pays there)
    assert set(simulate(AdaptiveK(k_max=8, explore_every=16), 0.9, 0.5, lambda n: 1.0, 400)[-100:]) - {0}


def simulate_free(policy: AdaptiveK, alphas: list[float], shadows: bool = True, seed: int = 0) -> list[int]:
    """A free drafter (prompt lookup) on a steep curve (break-even alpha ~0.8 at K = 1), its acceptance
    alphas[i] in round i: when K = 0 it reports a shadow (accepted with probability alpha: the target's
    p of its token), unless `shadows` is off (the policy then only learns from rounds it drafts)."""
    rng = random.Random(seed)
    policy.calibrate(lambda n: 1.0 + 0.8 * (n - 1), {"lookup": lambda: 0.001})
    chosen = []
    for alpha in alphas:
        k = policy.choose("lookup")
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        if k == 0 and shadows:
            policy.observe_shadow("lookup", alpha)
        policy.observe("lookup" if k else "none", k, n, 0.001 * k, k + 1, 1.0 + 0.8 * k)
        chosen.append(k)
    return chosen


def test_a_free_drafter_is_learned_from_shadows_and_never_re_tested():
    """Lookup on fresh text (acceptance 0.3, below break-even) then on copied text (0.97). With shadows
    it never drafts on the fresh text (no re-test rounds) and is back to drafting every round within
    100 rounds of the copy starting; the control without shadows pays ~18 re-tests on the fresh text
    and, its estimate frozen between them, drafts far less on the copy."""
    alphas = [0.3] * 300 + [0.97] * 200
    shadowed = AdaptiveK(k_max=8, explore_every=16)
    chosen = simulate_free(shadowed, alphas)
    blind = simulate_free(AdaptiveK(k_max=8, explore_every=16), alphas, shadows=False)
    assert sum(k > 0 for k in chosen[:300]) == 0 and shadowed.drafters["lookup"].shadowed
    assert sum(k > 0 for k in blind[:300]) >= 10
    assert all(k > 0 for k in chosen[400:])
    assert sum(chosen[300:]) >= 2 * sum(blind[300:])


class RecordingK(AdaptiveK):
    def observe_shadow(self, drafter: str, accept_probability: float, situation=None) -> None:
        self.shadows.append((drafter, accept_probability, situation))
        super().observe_shadow(drafter, accept_probability, situation)


def test_the_loop_reports_a_skipped_lookup_guess_with_the_targets_p_of_it():
    """Through the engine (greedy, a tiny float64 pair): in every round where lookup had a guess but K
    was 0, the policy hears p(guess) from the round's own pass: 1 exactly when the target emitted it,
    filed under the round's match class."""
    import torch

    from specdecode.core.probs import SamplingParams
    from specdecode.drafters.lookup import LookupConfig, LookupDrafter, lookup
    from specdecode.engine.config import GenerationConfig
    from specdecode.engine.engine import generate_tokens
    from specdecode.engine.round import TARGET
    from tests.tiny import tiny_pair

    target, _ = tiny_pair(seed=1, dtype=torch.float64)
    policy = RecordingK(k_max=4, prior_alpha=0.5)  # below break-even on the curve below: K stays 0
    policy.shadows = []
    policy.load_costs({"t_verify": {str(n): 1.0 + 0.9 * (n - 1) for n in range(1, 6)}, "t_step": {"lookup": 1e-4}})
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    config = LookupConfig(min_n=1, max_n=3)  # a guess in nearly every round
    context, checked = list(prompt), 0
    for rnd in generate_tokens(target, [LookupDrafter(config)], prompt, GenerationConfig(max_new_tokens=60,
                               sampling=SamplingParams(temperature=0.0), k=None), frozenset(), policy=policy):
        guess = lookup(context, 1, config)
        room = 60 - (len(context) - len(prompt)) > 1  # the last token of the budget has no room for a draft
        if rnd.sources == [TARGET] and guess and room:
            name, probability, situation = policy.shadows[checked]
            assert name == "lookup" and probability == float(guess[0] == rnd.tokens[0])
            assert situation == LookupDrafter(config).situation(context) is not None
            checked += 1
        context += rnd.tokens
    assert checked == len(policy.shadows) >= 10
    assert {p for _, p, _ in policy.shadows} == {0.0, 1.0}  # right and wrong guesses were both heard
    assert len({s for _, _, s in policy.shadows}) >= 2  # more than one match class was met


def test_shadow_evidence_moves_the_estimate_as_a_round_would():
    policy = AdaptiveK(k_max=8)
    for _ in range(200):
        policy.observe_shadow("lookup", 0.9)
    assert policy.alpha("lookup") == pytest.approx(0.9, abs=0.01)
    policy.begin()
    assert policy.alpha("lookup") == pytest.approx(policy.prior_alpha)
    assert not FixedK(3).observe_shadow("lookup", 0.5)  # FixedK ignores it (returns None)


def test_pads_to_a_cheaper_shape():
    times = {1: 1.0, 2: 1.0, 3: 1.5, 4: 1.1, 5: 1.2}
    policy = AdaptiveK(k_max=4)
    policy.calibrate(lambda n: times[n], {})
    assert policy.verify_size(3) == 4  # 3 tokens cost more than 4: pad
    assert policy.verify_size(2) == 2 and policy.verify_size(4) == 4
    assert policy.cost_model("x").t_verify[2] == 1.1  # the effective curve uses the padded size


def test_prior_keeps_early_rounds_sane():
    policy = AdaptiveK(k_max=8)
    policy.calibrate(lambda n: 1.0, {})
    assert policy.alpha("new") == pytest.approx(policy.prior_alpha)
    assert 1 <= policy.choose("new") <= 8


def test_acceptance_state_is_per_request_and_timings_are_kept():
    """begin() restarts alpha at the prior (so a seed reproduces its sample); timings stay."""
    policy = AdaptiveK(k_max=8)
    policy.calibrate(lambda n: 1.0, {"d": lambda: 0.1})
    for _ in range(50):
        policy.observe("d", 4, 0, 0.4, 5, 1.0)  # every draft rejected
    assert policy.alpha("d") < 0.2 and policy.choose("d") == 0
    policy.begin()
    assert policy.alpha("d") == pytest.approx(policy.prior_alpha) and policy.choose("d") > 0
    assert policy.t_step == {"d": 0.1} and policy.t_verify[1] == 1.0


def test_timings_frozen_unless_tracking():
    frozen, tracking = AdaptiveK(k_max=4), AdaptiveK(k_max=4, track_costs=True)
    for p in (frozen, tracking):
        p.calibrate(lambda n: 1.0, {"d": lambda: 0.1})
        p.observe("d", 2, 1, 2.0, 3, 5.0)  # much slower than calibrated
    assert frozen.t_step["d"] == 0.1 and frozen.t_verify[3] == 1.0
    assert tracking.t_step["d"] > 0.1 and tracking.t_verify[3] > 1.0


def test_calibration_interleaves_sizes_and_takes_medians():
    """Each sweep times every size and every drafter (a slow spell hits all alike); the warm-up
    sweep is discarded and a single spike does not move the median."""
    calls: list[object] = []
    spikes = {(1, 2): 9.0, ("d", 3): 9.0}  # (size or drafter, sweep) -> an outlier time

    def time_pass(n):
        calls.append(n)
        return spikes.get((n, calls.count(n) - 1), 1.0 + n / 10)

    def time_step():
        calls.append("d")
        return spikes.get(("d", calls.count("d") - 1), 0.2)

    policy = AdaptiveK(k_max=2, sweeps=3)
    policy.calibrate(time_pass, {"d": time_step})
    assert calls == [1, 2, 3, "d"] * 4  # one warm-up sweep and three measured, interleaved
    assert policy.t_verify == pytest.approx({1: 1.1, 2: 1.2, 3: 1.3})
    assert policy.t_step == pytest.approx({"d": 0.2})


def test_calibration_skips_sizes_that_do_not_fit():
    policy = AdaptiveK(k_max=4)
    policy.calibrate(lambda n: None if n > 3 else 1.0, {})
    assert sorted(policy.t_verify) == [1, 2, 3]


def test_fixed_k_and_validation():
    assert FixedK(3).choose("anything") == 3 and FixedK(3).verify_size(4) == 4
    FixedK(3).begin()
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(k_max=0)
    with pytest.raises(ValueError, match="sweeps"):
        AdaptiveK(sweeps=0)


def test_catch_up_cost_of_a_lagging_drafter_is_counted():
    """A draft that pays when in sync does not pay when it must first catch up on 16 tokens."""
    policy = AdaptiveK(k_max=8)
    policy.calibrate(lambda n: 1.0 + 0.1 * (n - 1), {"model": lambda: 0.1}, {"model": lambda: 0.2})
    assert policy.t_catchup == {"model": 0.2}
    assert policy.choose("model", lag=0) > 0
    assert policy.choose("model", lag=16) == 0  # 3.2 steps of catch-up outweigh the round's gain
    assert policy.cost_model("model", lag=16).round_time(2) == pytest.approx(1.2 + 0.2 + 3.2)
    assert policy.cost_model("model", lag=16).round_time(0) == pytest.approx(1.0)  # K = 0 catches up nothing


def test_pass_cost_between_and_beyond_measured_sizes_is_linear():
    policy = AdaptiveK(k_max=2)
    policy.load_costs({"t_verify": {"1": 0.05, "2": 0.08, "3": 0.10, "16": 0.40, "32": 0.70}, "t_step": {}})
    assert policy._t(2) == 0.08
    assert abs(policy._t(8) - (0.10 + 5 * 0.30 / 13)) < 1e-12  # between 3 and 16
    assert abs(policy._t(48) - (0.70 + 16 * 0.30 / 16)) < 1e-12  # beyond 32: the last slope
    assert AdaptiveK()._t(40) == 1.0  # nothing measured: flat


def test_for_request_shares_costs_not_acceptance():
    parent = AdaptiveK(k_max=3)
    parent.load_costs({"t_verify": {"1": 0.05}, "t_step": {"model": 0.01}})
    parent.observe("model", 3, 0, 0.03, 4, 0.1)
    child = parent.for_request()
    assert child.t_verify is parent.t_verify and child.t_step is parent.t_step
    assert child.drafters == {} and parent.drafters
    child.observe("model", 3, 3, 0.03, 4, 0.1)
    assert child.alpha("model") > parent.alpha("model")


def test_a_batch_prices_drafts_on_the_rounds_it_has_run():
    """The calibrated curve (one sequence, one row's verification) said 4 tokens cost 134 ms; the
    batch's own rounds of 4 one-token rows took 105 ms. Against the calibrated 134, a K = 8 draft
    beside three rows looks 3% ahead (llama.cpp's flat stretch: 12 tokens 296 ms); against what the
    batch pays it loses 20%, so K falls to 0. A lone row keeps the calibrated costs (its K, and so a
    seeded sample, must not depend on timing noise)."""
    curve = {1: 0.0407, 4: 0.1339, 8: 0.3069, 12: 0.2965, 16: 0.3375}
    policy = AdaptiveK(k_max=8)
    policy.load_costs({"t_verify": {str(n): t for n, t in curve.items()}, "t_step": {"lookup": 1e-4}})
    policy.drafters["lookup"] = _DrafterState(accepted=90, tested=100)  # alpha ~0.9
    load = BatchLoad(3, 3.0)  # three one-token rows
    assert policy.choose("lookup", 0, load) == 8  # the calibrated curve alone: drafting looks ahead
    request = policy.for_request()  # every request's policy sees the batch's measurements
    request.drafters["lookup"] = _DrafterState(accepted=90, tested=100)
    alone = policy.choose("lookup", 0, ALONE)
    for _ in range(4):  # a round of four rows, each reporting it
        request.observe_batch(4, 0.105, rows=4)
    assert policy.t_batch.get(4) == pytest.approx(0.105) and request.t_batch is policy.t_batch
    assert request.choose("lookup", 0, load) == 0
    assert request.choose("lookup", 0, ALONE) == alone  # a lone row: the calibrated curve, unchanged
    # a size seen at last is priced as seen: 12 tokens at 150 ms make K = 8 pay again
    request.observe_batch(12, 0.150, rows=1)
    assert request.choose("lookup", 0, load) == 8


def test_a_rounds_reports_weigh_as_one_observation():
    policy = AdaptiveK(ema=0.2)
    policy.observe_batch(4, 0.1, rows=4)  # the first report sets the size's cost
    for _ in range(4):  # one round of four rows
        policy.observe_batch(4, 0.2, rows=4)
    # a geometric EMA: each report takes the estimate 5% of the way to 0.2 in log terms
    assert policy.t_batch.get(4) == pytest.approx(0.2 * 0.5 ** (0.95 ** 4))
    assert policy.t_batch.get(4) == pytest.approx(0.2 * 0.5 ** 0.8, rel=0.02)  # about one observation at ema 0.2
    assert "t_batch" not in policy.costs()  # this process's batch, not the machine's calibration


def test_a_size_not_run_for_a_while_follows_the_machine():
    """A slow spell (every 4-token round 20% slower) moves the 12-token size too, by the square root
    of the change, where a table of last values would keep the fast spell's 0.3 s (the control)."""
    policy = AdaptiveK(ema=0.2)
    policy.observe_batch(4, 0.1, rows=1)
    policy.observe_batch(12, 0.3, rows=1)
    for _ in range(200):
        policy.observe_batch(4, 0.12, rows=1)
    assert policy.t_batch.get(4) == pytest.approx(0.12, rel=1e-6)
    assert policy.t_batch.get(12) == pytest.approx(0.3 * 1.2 ** 0.5, rel=1e-6)
    last_values = {4: 0.12, 12: 0.3}  # the control: a size keeps its last run's value
    assert abs(last_values[12] - policy.t_batch.get(12)) > 0.025
    policy.observe_batch(12, 0.36, rows=1)  # its own reports still take it the whole way
    for _ in range(200):
        policy.observe_batch(12, 0.36, rows=1)
    assert policy.t_batch.get(12) == pytest.approx(0.36, rel=1e-3)
    assert policy.t_batch.get(4) > 0.12  # ... and the others follow half-way until they run again


def _lockstep_policy(draft_steps: dict[int, float]) -> AdaptiveK:
    """A flat target curve (a GPU's: 40 tokens cost what one does), a draft model step of 20 ms
    alone (c = 2.5), alpha ~0.6, and lockstep draft steps of `draft_steps` by rows, as measured."""
    policy = AdaptiveK(k_max=8)
    policy.load_costs({"t_verify": {str(n): 0.05 for n in range(1, 41)}, "t_step": {"model": 0.02}})
    policy.drafters["model"] = _DrafterState(accepted=60, tested=100)
    for rows, t in draft_steps.items():
        policy.observe_draft_batch("model", rows, t, reporters=1)  # a size's first report sets it
    return policy


def test_a_lockstep_draft_step_is_charged_what_it_adds_to_the_batch():
    """Three rows already draft K = 4 with the draft model; their 4 lockstep steps are paid whatever
    this row does. Where a step of 4 rows costs what one does, this row's first 4 steps are free
    and it drafts 4 (alone, alpha 0.6 at c = 2.5 pays only K = 1). Where each row adds a whole
    step (a step of b rows costs b steps), it is charged K steps as if alone, and drafts 1."""
    others = (("model", 4),) * 3
    load = BatchLoad(15, 3 * 2.0, others)
    flat, steep = _lockstep_policy({b: 0.02 for b in range(1, 5)}), _lockstep_policy({b: 0.02 * b for b in range(1, 5)})
    assert flat.choose("model", 0, ALONE) == steep.choose("model", 0, ALONE) == 1
    assert flat.choose("model", 0, load) == 4
    assert steep.choose("model", 0, load) == 1
    # the round's draft loop: T_d(rows still drafting) summed over the steps, per drafter
    assert steep._shared_draft_seconds(others + (("model", 6),)) == pytest.approx(4 * 0.08 + 2 * 0.02)
    lookup_step = steep._t_draft_step("lookup", 1)  # outside the lockstep: its own steps
    assert steep._shared_draft_seconds(others + (("lookup", 2),)) == pytest.approx(4 * 0.06 + 2 * lookup_step)
    # not measured yet: the draft's step scaled by the target's calibrated curve (flat here: free)
    unmeasured = _lockstep_policy({})
    assert unmeasured._t_draft_step("model", 3) == pytest.approx(0.02) and unmeasured.choose("model", 0, load) == 4
    unmeasured.load_costs({"t_verify": {"1": 0.05, "2": 0.08, "4": 0.14}, "t_step": {"model": 0.02}})
    assert unmeasured._t_draft_step("model", 2) == pytest.approx(0.02 * 0.08 / 0.05)
    assert unmeasured._t_draft_step("model", 0) == 0.0


def test_lockstep_draft_costs_are_the_batchs_shared_by_every_request():
    policy = AdaptiveK(ema=0.2)
    request = policy.for_request()
    request.observe_draft_batch("model", 2, 0.03, reporters=2)  # the first report sets the cost
    request.observe_draft_batch("model", 2, 0.05, reporters=2)
    assert policy.t_draft_batch.get(("model", 2)) == pytest.approx(0.03 * (0.05 / 0.03) ** 0.1)  # half an observation
    assert request.t_draft_batch is policy.t_draft_batch and "t_draft_batch" not in policy.costs()
    FixedK(2).observe_draft_batch("model", 2, 0.03, reporters=1)  # a pinned K learns nothing


def test_batch_sizes_are_calibrated_when_missing():
    policy = AdaptiveK(k_max=2, batch_sizes=(8, 16), sweeps=1)
    policy.load_costs({"t_verify": {"1": 0.05, "2": 0.06, "3": 0.07}, "t_step": {}})
    assert policy.wants_calibration()  # a batch needs sizes this file lacks
    policy.calibrate(lambda n: 0.01 * n, {})
    assert set(policy.t_verify) == {1, 2, 3, 8, 16} and not policy.wants_calibration()


def test_a_smaller_k_maxs_costs_are_calibrated_again():
    """A calibration file written by a policy with k_max = 4 (sizes 1..5) was loaded by one with k_max = 8,
    which then had no cost for passes of 6-9 tokens (benchmarks/lookup_bound.py died on a KeyError)."""
    policy = AdaptiveK(k_max=8, sweeps=1)
    policy.load_costs({"t_verify": {str(n): 0.05 + 0.01 * n for n in range(1, 6)}, "t_step": {}})
    assert policy.wants_calibration()
    policy.calibrate(lambda n: 0.01 * n, {})
    assert set(policy.t_verify) == set(range(1, 10)) and not policy.wants_calibration()
    assert not _loaded(AdaptiveK(k_max=4), range(1, 6)).wants_calibration()  # what it needs, it has


def _loaded(policy: AdaptiveK, sizes) -> AdaptiveK:
    policy.load_costs({"t_verify": {str(n): 0.01 * n for n in sizes}, "t_step": {}})
    return policy


def test_tree_alternatives_are_kept_while_they_pay():
    """A flat pass cost (GPU-like) keeps every alternative with a gain; a pass whose every extra token
    costs most of a step (this CPU) keeps none; in between, the better ones first."""
    gains = [0.3, 0.2, 0.05]
    flat, steep, middle = AdaptiveK(), AdaptiveK(), AdaptiveK()
    flat.load_costs({"t_verify": {str(n): 0.050 for n in range(1, 17)}, "t_step": {"model": 0.002}})
    steep.load_costs({"t_verify": {str(n): 0.050 * n for n in range(1, 17)}, "t_step": {"model": 0.002}})
    middle.load_costs({"t_verify": {str(n): 0.050 + 0.004 * n for n in range(1, 17)}, "t_step": {"model": 0.002}})
    assert flat.tree_alternatives("model", 3, gains) == 3
    assert steep.tree_alternatives("model", 3, gains) == 0
    assert middle.tree_alternatives("model", 3, gains) == 2
    assert FixedK(3).tree_alternatives("model", 3, gains) == 3  # a pinned shape is kept


def test_acceptance_is_learned_per_situation():
    """Prompt lookup after a 2-3 token match is right 40% of the time, after a 16+ token match 97%
    (the embedded pair measured 37-53% and 95-96%). On a CPU-like curve (each token 0.75 of a step)
    the policy that keeps them apart drafts on long matches and never on short ones; the
    control that pools the same evidence (one estimate, ~0.69) cannot draft on either."""
    curve = {str(n): 1.0 + 0.75 * (n - 1) for n in range(1, 10)}
    apart, pooled = AdaptiveK(k_max=8), AdaptiveK(k_max=8)
    for policy in (apart, pooled):
        policy.load_costs({"t_verify": curve, "t_step": {"lookup": 1e-4}})
    for _ in range(100):
        for situation, p in ((2, 0.4), (5, 0.97)):
            apart.observe_shadow("lookup", p, situation)
            pooled.observe_shadow("lookup", p)
    assert apart.choose("lookup", situation=5) == 3  # the optimum at alpha 0.97 on this curve
    assert apart.choose("lookup", situation=2) == 0
    assert pooled.choose("lookup") == 0
    assert apart.alpha("lookup", 5) == pytest.approx(0.97, abs=0.03) and apart.alpha("lookup") == apart.prior_alpha
    assert apart.alpha("lookup", 3) == apart.situation_prior < apart.prior_alpha  # a class not yet met: neutral
    # a drafted round's evidence goes to its situation too
    apart.observe("lookup", 8, 0, 0.0, 9, 7.0, situation=5)
    assert apart.alpha("lookup", 5) < 0.93 and apart.alpha("lookup", 2) == pytest.approx(0.4, abs=0.02)


def test_a_measured_situation_starts_at_its_prior():
    """A request's first rounds: prompt lookup's 16+ class (measured 0.96) drafts before any
    evidence, its 2-3 class (0.50) does not, on a CPU-like curve; a bare situation starts neutral,
    and evidence still moves a measured class (held as `measured_prior_weight` tested positions).
    Control: with the neutral prior, the 16+ class does not draft at first (what cost code editing
    4.6%, replayed on the embedded pair's outputs)."""
    curve = {str(n): 1.0 + 0.5 * (n - 1) for n in range(1, 10)}
    policy = AdaptiveK(k_max=8)
    policy.load_costs({"t_verify": curve, "t_step": {"lookup": 1e-4}})
    long, short = Situation(5, 0.96), Situation(2, 0.50)
    assert policy.alpha("lookup", long) == 0.96 and policy.alpha("lookup", 5) == policy.situation_prior
    assert policy.choose("lookup", situation=long) == 6 and policy.choose("lookup", situation=short) == 0
    assert policy.choose("lookup", situation=5) == 0  # the control: neutral, no draft yet
    for _ in range(4):
        policy.observe("lookup", 8, 0, 0.0, 9, 5.0, situation=long)
    assert policy.alpha("lookup", long) < 0.5 and policy.choose("lookup", situation=long) == 0


class ObservingK(AdaptiveK):
    def observe(self, drafter, drafted, accepted, t_draft, n_verified, t_verify, situation=None) -> None:
        self.rounds.append((drafter, drafted, situation))
        super().observe(drafter, drafted, accepted, t_draft, n_verified, t_verify, situation)


@pytest.mark.parametrize("kind", ["lookup", "suffix"])
def test_the_loop_files_a_drafted_round_under_its_match_class(kind):
    """Through the engine (greedy, tiny float64 pair, lookup or suffix on a repeating prompt): every
    drafted round's evidence goes to the class of the match it copied from, computed before the round."""
    import torch

    from specdecode.core.probs import SamplingParams
    from specdecode.drafters.lookup import LookupConfig, LookupDrafter
    from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
    from specdecode.engine.config import GenerationConfig
    from specdecode.engine.engine import generate_tokens
    from tests.tiny import tiny_pair

    target, _ = tiny_pair(seed=1, dtype=torch.float64)
    policy = ObservingK(k_max=4, situation_prior=0.9)  # draft from the first round: K > 0 to observe
    policy.rounds = []
    policy.load_costs({"t_verify": {str(n): 1.0 for n in range(1, 6)}, "t_step": {kind: 1e-4}})  # flat
    fresh = (lambda: LookupDrafter(LookupConfig(min_n=1, max_n=3))) if kind == "lookup" else \
        (lambda: SuffixDrafter(SuffixConfig(min_n=1, max_n=3)))
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8]
    context, drafted, classes = list(prompt), 0, set()
    for rnd in generate_tokens(target, [fresh()], prompt, GenerationConfig(max_new_tokens=40,
                               sampling=SamplingParams(temperature=0.0), k=None), frozenset(), policy=policy):
        name, k, situation = policy.rounds[-1]
        if k:
            assert name == kind and situation == fresh().situation(context) is not None
            classes.add(situation)
            drafted += 1
        else:
            assert situation is None
        context += rnd.tokens
    assert drafted >= 3 and len(classes) >= 2  # the rounds met more than one class


def test_k_follows_a_cost_curve_changed_in_place():
    """The effective curve is kept between rounds (it was recomputed ~3 times a round); a curve changed
    in place (tracked timings, a recalibration) must still change K at once."""
    policy = AdaptiveK(k_max=4)
    policy.t_verify.update({n: 1.0 for n in range(1, 6)})  # flat: drafting pays
    policy.t_step["sim"] = 0.05
    assert policy.choose("sim") >= 2
    policy.t_verify.update({n: float(n) for n in range(1, 6)})  # each token a full step: it never pays
    assert policy.choose("sim") == 0
    policy.t_verify.update({n: 1.0 for n in range(1, 6)})  # and back
    assert policy.choose("sim") >= 2
