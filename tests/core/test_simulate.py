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


def test_batches_stay_bounded_at_large_vocab_and_keep_the_statistics(monkeypatch):
    """A fixed 4096 rounds a batch, drafted from q expanded to [B, K, V], allocated 26 GB at V = 100,000,
    K = 8. Now each batch verifies at most 2**24 target entries, and the rounds still match the
    formulas (5 s.e.; chi-square at 1e-4) across many batches."""
    import specdecode.core.simulate as sim

    shapes = []

    def recording_verify(draft, q, p, rand):
        shapes.append(tuple(p.shape))
        return real_verify(draft, q, p, rand)

    real_verify = sim.verify
    g = torch.Generator().manual_seed(5)
    p, q = random_pair(20_000, g)
    monkeypatch.setattr(sim, "verify", recording_verify)
    res = sim.simulate_rounds(p, q, 3, rounds=1_500, generator=g)
    assert max(b * k1 * v for b, k1, v in shapes) <= 2**24 and len(shapes) > 1  # 128 MB of float64 a batch
    assert sum(b for b, _, _ in shapes) == res.rounds == sum(res.n_counts)
    var = sum((i + 1 - res.expected_tokens) ** 2 * pr for i, pr in enumerate(res.n_pmf))
    assert abs(res.mean_tokens - res.expected_tokens) < 5 * math.sqrt(var / res.rounds)
    assert chi_square(res.n_counts, res.n_pmf).p_value > 1e-4


def test_drafts_follow_q_and_never_hit_a_zero_weight_token():
    """Drafts come from q's one cumulative sum: zero-weight tokens (first, inner, last) never appear,
    and the rest follow q (chi-square at 1e-4)."""
    from specdecode.core.simulate import _draw

    q = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0], dtype=torch.float64)
    drafts = _draw(q.cumsum(0), (2_000, 4), torch.Generator().manual_seed(0))
    counts = torch.bincount(drafts.flatten(), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert chi_square(counts.tolist(), q.tolist()).p_value > 1e-4
