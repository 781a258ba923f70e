"""The documents' numbers, reproduced by the theory toolkit."""

import math

import pytest
import torch

from specdecode.core.classic import two_token_example
from specdecode.core.theory import (CostModel, acceptance_rate, break_even_alpha, expected_tokens, optimal_k,
                                    speedup, tokens_per_round_pmf, tv_distance)

ALPHAS = [0.5, 0.6, 0.7, 0.8, 0.9]


@pytest.mark.parametrize("k, table, digits", [
    (4, [1.94, 2.31, 2.77, 3.36, 4.10], 2),
    (8, [1.996, 2.47, 3.20, 4.33, 6.13], None),
])
def test_expected_tokens_table(k, table, digits):
    for alpha, expected in zip(ALPHAS, table):
        places = digits if digits is not None else len(str(expected).split(".")[1])
        assert round(expected_tokens(alpha, k), places) == pytest.approx(expected), (alpha, k)


def test_expected_tokens_worked_example_and_edges():
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.32768) / 0.2)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.7, 0) == 1.0
    # continuity at alpha -> 1
    assert expected_tokens(1 - 1e-9, 6) == pytest.approx(7.0, rel=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.85, 1.0])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_pmf_sums_to_one_and_matches_mean(alpha, k):
    pmf = tokens_per_round_pmf(alpha, k)
    assert len(pmf) == k + 1
    assert sum(pmf) == pytest.approx(1.0)
    assert sum((i + 1) * pr for i, pr in enumerate(pmf)) == pytest.approx(expected_tokens(alpha, k))


@pytest.mark.parametrize("alpha, c, k, expected", [
    (0.8, 10, 4, 2.40), (0.8, 10, 8, 2.40), (0.9, 10, 8, 3.40), (0.6, 10, 4, 1.65), (0.8, 5, 4, 1.87),
])
def test_speedup_table(alpha, c, k, expected):
    assert round(speedup(alpha, c, k), 2) == pytest.approx(expected)


def test_exercise_2():
    assert round(speedup(0.7, 8, 4), 2) == pytest.approx(1.85)
    assert round(speedup(0.7, 8, 8), 2) == pytest.approx(1.60)
    assert speedup(0.7, 8, 4) > speedup(0.7, 8, 8)
    be = break_even_alpha(4, 8)
    assert round(be, 2) == pytest.approx(0.34)
    assert expected_tokens(0.34, 4) > 1.5 > expected_tokens(0.33, 4)
    assert speedup(be, 8, 4) == pytest.approx(1.0, abs=1e-9)


def test_document_worked_example_2x():
    # decode 10 ms/token; draft 3 ms for 4 tokens; verification 12 ms; 3 tokens per round
    t_decode, t_draft_round, t_verify, tokens = 10.0, 3.0, 12.0, 3.0
    assert tokens * t_decode / (t_draft_round + t_verify) == pytest.approx(2.0)
    # the same through the cost model: verify(5 tokens) = 12, a draft step 0.75
    cost = CostModel.measured(t_draft=0.75, t_verify=[10, 10, 10, 10, 12])
    assert cost.round_time(4) == pytest.approx(15.0)


def test_optimal_k():
    f = lambda a, c, k: c / (c + k) * (1 - a ** (k + 1)) / (1 - a)
    for alpha in [0.3, 0.6, 0.7, 0.8, 0.9]:
        for c in [2, 5, 8, 20]:
            best = optimal_k(alpha, c, k_max=16)
            assert all(f(alpha, c, best) >= f(alpha, c, k) - 1e-12 for k in range(0, 17))
    assert optimal_k(0.05, 2.0) == 0  # speculation does not pay: K = 0
    assert optimal_k(0.9, 20.0) > optimal_k(0.9, 3.0)  # cheaper drafts -> longer drafts


def test_cost_curve_generalises_flat_formula():
    flat = CostModel.flat(8.0, max_k=10)
    for k in range(0, 11):
        assert flat.speedup(0.7, k) == pytest.approx(speedup(0.7, 8.0, k))
    # a verification curve that grows with K moves the optimum down
    growing = CostModel.measured(t_draft=1 / 8, t_verify=[1 + 0.25 * n for n in range(11)])
    assert growing.optimal_k(0.7) < flat.optimal_k(0.7)
    assert growing.c == pytest.approx(8 * 1.0)


def test_alpha_and_tv():
    law = two_token_example()
    assert law.alpha == pytest.approx(0.7)
    p = torch.tensor([0.7, 0.3], dtype=torch.float64)
    q = torch.tensor([0.4, 0.6], dtype=torch.float64)
    assert acceptance_rate(p, q) == pytest.approx(1 - tv_distance(p, q))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)
        b = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), 0)
        assert acceptance_rate(a, b) == pytest.approx(1 - tv_distance(a, b), abs=1e-12)


@pytest.mark.parametrize("call, match", [
    (lambda: expected_tokens(1.5, 4), "alpha"),
    (lambda: expected_tokens(0.5, -1), "K"),
    (lambda: speedup(0.5, 0, 4), "c"),
    (lambda: break_even_alpha(0, 8), "K"),
    (lambda: acceptance_rate(torch.ones(3) / 3, torch.ones(4) / 4), "same shape"),
    (lambda: acceptance_rate(torch.tensor([0.5, 0.6]), torch.tensor([0.5, 0.5])), "probability"),
    (lambda: CostModel.measured(0.1, []), "t_verify"),
    (lambda: CostModel.flat(5, max_k=4).round_time(5), "covers"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_break_even_when_drafts_never_pay():
    assert break_even_alpha(4, 0.5) is None  # K/c = 8 > K: even alpha = 1 cannot pay
    assert break_even_alpha(4, 1.0) == 1.0  # c = 1: only perfect drafts break even
    assert math.isclose(speedup(1.0, 0.5, 4), 5 * 0.5 / 4.5)


def test_break_even_is_precise_for_a_nearly_free_draft():
    """K = 1: E[N] = 1 + alpha = 1 + 1/c, so alpha = 1/c. The bisection stopped at an absolute 1e-12 and gave
    1.36e-12 at c = 1e12; it now stops at a relative tolerance."""
    assert math.isclose(break_even_alpha(1, 1e12), 1e-12, rel_tol=1e-3)
    assert math.isclose(break_even_alpha(1, 3.0), 1 / 3, rel_tol=1e-9)
