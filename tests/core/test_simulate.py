"""The Monte Carlo round simulator (exercise 6) against the formulas."""

import math

import pytest
import torch

from specdecode.core.simulate import random_pair, simulate_rounds
from specdecode.stats import chi_square


@pytest.mark.parametrize("k", [1, 4, 8])
def test_simulation_matches_theory(k):
    """Mean tokens per round within 5 s.e. of E[N], N's histogram and the emitted-token
    histogram pass chi-square at 1e-4. False-failure probability < 3e-4 per case; fixed seed."""
    g = torch.Generator().manual_seed(k)
    p, q = random_pair(100, g)
    res = simulate_rounds(p, q, k, rounds=20_000, generator=g)
    var = sum((i + 1 - res.expected_tokens) ** 2 * pr for i, pr in enumerate(res.n_pmf))
    assert abs(res.mean_tokens - res.expected_tokens) < 5 * math.sqrt(var / res.rounds)
    assert chi_square(res.n_counts, res.n_pmf).p_value > 1e-4
    assert chi_square(res.token_counts, res.p).p_value > 1e-4
    assert sum(res.n_counts) == res.rounds


def test_simulator_detects_q_instead_of_p():
    """Negative control: the emitted histogram is compared with q (wrong) and must fail."""
    g = torch.Generator().manual_seed(0)
    p, q = random_pair(100, g, closeness=0.5)
    res = simulate_rounds(p, q, 4, rounds=20_000, generator=g)
    assert chi_square(res.token_counts, q.tolist()).p_value < 1e-4


def test_simulator_validation():
    g = torch.Generator()
    with pytest.raises(ValueError, match="same length"):
        simulate_rounds(torch.ones(3) / 3, torch.ones(4) / 4, 2, 10, g)
    with pytest.raises(ValueError, match="K must"):
        simulate_rounds(torch.ones(3) / 3, torch.ones(3) / 3, 0, 10, g)
