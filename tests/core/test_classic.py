"""Classic rejection sampling: uniformity and expected call counts, plus the two-token world."""

from fractions import Fraction

import numpy as np
import pytest

from specdecode.core.classic import (BiasedCoin, UniformSource, expected_calls_basic, expected_calls_recycling,
                                     expected_flips_fair_coin, fair_coin, rand7_basic, rand7_recycling,
                                     two_token_example)
from specdecode.stats import chi_square

N = 60_000


def test_closed_forms():
    assert expected_calls_basic() == Fraction(50, 21)
    assert round(float(expected_calls_basic()), 3) == 2.381
    assert round(float(expected_calls_recycling()), 4) == 2.2156
    assert round(float(expected_calls_recycling()), 2) == 2.22  # the document's "2.21" is a truncation
    assert expected_calls_recycling() < expected_calls_basic()


@pytest.mark.parametrize("rand7, expected", [(rand7_basic, expected_calls_basic()),
                                             (rand7_recycling, expected_calls_recycling())])
def test_rand7_uniform_and_call_count(rand7, expected):
    """Chi-square uniformity over 1..7 and the mean number of rand5 calls.

    False-failure probability: 1e-4 for the chi-square threshold; the mean-calls
    tolerance is 5 standard errors (per-call variance < 4, so the s.e. is < 0.01 at
    N = 60000), i.e. < 1e-6. Fixed seed.
    """
    src = UniformSource(5, np.random.default_rng(0))
    draws = [rand7(src) for _ in range(N)]
    counts = np.bincount(draws, minlength=8)[1:]
    assert set(draws) == set(range(1, 8))
    assert chi_square(counts.tolist(), [1 / 7] * 7).p_value > 1e-4
    assert src.calls / N == pytest.approx(float(expected), abs=0.05)


def test_uniformity_test_has_power():
    """Negative control: `rand5() + rand5() mod 7`-style shortcuts are caught by the same test."""
    src = UniformSource(5, np.random.default_rng(1))
    biased = [(5 * (src() - 1) + src() - 1) % 7 + 1 for _ in range(N)]  # no rejection: 1..4 get 4/25
    counts = np.bincount(biased, minlength=8)[1:]
    assert chi_square(counts.tolist(), [1 / 7] * 7).p_value < 1e-4


def test_recycling_saves_calls_measurably():
    a, b = UniformSource(5, np.random.default_rng(2)), UniformSource(5, np.random.default_rng(2))
    for _ in range(N):
        rand7_basic(a)
        rand7_recycling(b)
    assert b.calls < a.calls


@pytest.mark.parametrize("bias", [0.2, 0.5, 0.9])
def test_von_neumann_fair_coin(bias):
    """Heads frequency 1/2 within 5 s.e. (false failure < 1e-6); flips per output as expected."""
    coin = BiasedCoin(bias, np.random.default_rng(3))
    n = 20_000
    heads = sum(fair_coin(coin) for _ in range(n))
    assert abs(heads / n - 0.5) < 5 * (0.25 / n) ** 0.5
    assert coin.calls / n == pytest.approx(expected_flips_fair_coin(bias), rel=0.05)


def test_biased_coin_validation():
    with pytest.raises(ValueError, match="bias"):
        BiasedCoin(1.0, np.random.default_rng())


def test_two_token_example():
    law = two_token_example()
    assert law.accept_prob == pytest.approx((1.0, 0.5))
    assert law.alpha == pytest.approx(0.7)
    assert law.residual == pytest.approx((1.0, 0.0))
    assert law.emitted == pytest.approx((0.7, 0.3))
