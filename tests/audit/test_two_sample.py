"""The black-box audit's statistics on synthetic laws (numpy and scipy only, seconds).

- false failures: two samples of one law reject at about the stated level, over many seeds;
- power: a difference of the reported detectable TV, of the least detectable shape (proportional to
  the law), is detected about 90% of the time, and a sharper one (a temperature change) more often;
- the negative control of these tests: at a quarter of that TV the power is far below 90%, so the
  power tests can fail;
- a law known exactly (the one-sample test) detects a TV sqrt(2) smaller at the same samples.

Each rate is checked within 4 binomial standard deviations (a false failure of these tests has
probability about 6e-5 each); every seed is fixed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from specdecode.stats import (chi_square, chi_square_two_sample, detectable_tv, merge_small_cells,
                              noncentrality_for_power, samples_for_tv, two_sample_cells)

LAWS = {"uniform 6": np.full(6, 1 / 6), "zipf 30": (lambda w: w / w.sum())(1 / np.arange(1, 31) ** 1.2),
        "peaked 12": (lambda w: w / w.sum())(np.exp(-0.8 * np.arange(12)))}


def within(rate: float, expected: float, trials: int, sds: float = 4.0) -> bool:
    return abs(rate - expected) <= sds * math.sqrt(expected * (1 - expected) / trials)


def rejections(p_a: np.ndarray, p_b: np.ndarray, n: int, level: float, trials: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    hits = [chi_square_two_sample(rng.multinomial(n, p_a), rng.multinomial(n, p_b)).p_value < level
            for _ in range(trials)]
    return float(np.mean(hits))


@pytest.mark.parametrize("law", list(LAWS))
@pytest.mark.parametrize("n", [60, 400])
def test_false_failures_are_at_the_stated_level(law, n):
    """Same law on both sides, 4000 seeds: the rejection rate at level 0.05 is 0.05 (cells merged to
    5 expected keep the chi-square approximation honest even with 60 samples over 30 cells)."""
    rate = rejections(LAWS[law], LAWS[law], n, 0.05, 4000, seed=n)
    assert within(rate, 0.05, 4000), rate


def test_false_failures_at_a_small_level_stay_below_it():
    """At 0.005 (a Bonferroni share) the rate is still at most the level (within sampling error)."""
    rate = rejections(LAWS["zipf 30"], LAWS["zipf 30"], 200, 0.005, 8000, seed=5)
    assert rate <= 0.005 + 4 * math.sqrt(0.005 * 0.995 / 8000), rate


def proportional_difference(r: np.ndarray, tv: float) -> tuple[np.ndarray, np.ndarray]:
    """Two laws at TV `tv` around r whose difference is proportional to r (+ on about half the mass, -
    on the rest): the shape that `detectable_tv` bounds (equality in Cauchy-Schwarz)."""
    order = np.argsort(-r)
    plus = np.zeros(len(r), bool)
    mass = 0.0
    for i in order:
        if mass + r[i] <= 0.5 + 1e-12:
            plus[i], mass = True, mass + r[i]
    d = np.where(plus, r * tv / mass, -r * tv / (1 - mass))
    return r + d / 2, r - d / 2


@pytest.mark.parametrize("law,n,level", [("uniform 6", 300, 1e-3), ("peaked 12", 500, 1e-2)])
def test_power_is_as_reported(law, n, level):
    r = LAWS[law]
    cells = len(two_sample_cells(np.round(n * r), np.round(n * r))[0])
    tv = detectable_tv(n / 2, cells - 1, level)
    p_a, p_b = proportional_difference(r, tv)
    assert 0.5 * abs(p_a - p_b).sum() == pytest.approx(tv)
    assert within(rejections(p_a, p_b, n, level, 2000, seed=1), 0.9, 2000)
    if np.ptp(r) == 0:
        return  # no temperature moves a uniform law (the loop below would never end)
    # a temperature change of the same TV is easier to see: the bound holds for every shape
    logits = np.log(r)
    t = 1.0
    hot = r
    while 0.5 * abs(hot - r).sum() < tv:
        t += 0.01
        assert t < 100, "no temperature reaches the TV"
        hot = np.exp(logits / t) / np.exp(logits / t).sum()
    assert rejections(hot, r, n, level, 1000, seed=2) >= 0.9 - 4 * math.sqrt(0.09 / 1000)


def test_negative_control_a_quarter_of_the_detectable_tv_is_mostly_missed():
    """The power tests above could fail: a difference a quarter the size goes unseen most of the time."""
    r, n, level = LAWS["uniform 6"], 300, 1e-3
    tv = detectable_tv(n / 2, 5, level)
    p_a, p_b = proportional_difference(r, tv / 4)
    assert rejections(p_a, p_b, n, level, 1000, seed=3) < 0.2


def test_a_known_law_detects_a_tv_sqrt2_smaller():
    """The one-sample test (against reported probabilities) at n has the two-sample test's power at 2n a side."""
    n, dof, level = 300, 7, 1e-3
    assert detectable_tv(n / 2, dof, level) / detectable_tv(n, dof, level) == pytest.approx(math.sqrt(2))
    r = LAWS["uniform 6"]
    tv = detectable_tv(n, 5, level)
    p_a, _ = proportional_difference(r, 2 * tv)  # p_a is at TV `tv` from r
    rng = np.random.default_rng(4)
    hits = np.mean([chi_square(rng.multinomial(n, p_a), r).p_value < level for _ in range(2000)])
    assert within(hits, 0.9, 2000), hits


def test_samples_for_tv_inverts_detectable_tv():
    for tv, dof, level in [(0.1, 5, 1e-4), (0.05, 12, 1e-5), (0.3, 1, 1e-3)]:
        n = samples_for_tv(tv, dof, level)
        assert detectable_tv(n / 2, dof, level) <= tv < detectable_tv((n - 1) / 2, dof, level) * 1.0001
        assert samples_for_tv(tv, dof, level, two_sample=False) == pytest.approx(n / 2, abs=1)


def test_noncentrality_reaches_the_power():
    from scipy import stats
    lam = noncentrality_for_power(4, 1e-3, 0.9)
    assert stats.ncx2.sf(stats.chi2.isf(1e-3, 4), 4, lam) == pytest.approx(0.9, abs=1e-5)
    with pytest.raises(ValueError):
        noncentrality_for_power(0, 1e-3)


def test_a_table_of_one_frequent_outcome_is_tested_exactly():
    """Merged into one cell, the table falls back to Fisher's test of (the frequent outcome, the rest)."""
    same = chi_square_two_sample([98, 1, 1], [99, 1, 0])
    assert same.test == "fisher" and same.p_value > 0.5
    lopsided = chi_square_two_sample([300, 0, 0], [290, 3, 3])
    assert lopsided.test == "fisher" and lopsided.p_value < 0.05
    assert chi_square_two_sample([100, 0], [83, 0]).p_value == 1.0  # one outcome on both sides
    with pytest.raises(ValueError):
        chi_square_two_sample([0, 0], [3, 4])


def test_merging_keeps_big_cells_and_pools_the_rest():
    assert merge_small_cells(np.array([10.0, 6, 2, 2, 2])).tolist() == [0, 1, 2, 2, 2]  # pool of 6 kept
    assert merge_small_cells(np.array([10.0, 6, 2, 1])).tolist() == [0, 1, 1, 1]  # pool of 3 folds into 6
    assert merge_small_cells(np.array([2.0, 1, 1])).tolist() == [-1, -1, -1]  # nothing to test
