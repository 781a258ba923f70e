"""Reproducible sampling's noise: a function of (seed, position) alone, and exact as a sampler.

The law test draws one token per seed from a fixed p (chi-square, false-failure probability
1e-3 at fixed seeds); its negative control is a "noise" with the exponentials replaced by
uniforms, which is not an exact race and must fail.
"""

import pytest
import torch

from specdecode.core.probs import sample_with_noise
from specdecode.core.reproducible import CounterNoise, position_seed, sample_token, verify_equal
from specdecode.stats import chi_square

P = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0], dtype=torch.float64)


def test_noise_is_a_function_of_seed_and_position():
    a, b = CounterNoise(7), CounterNoise(7)
    assert torch.equal(a.noise(3, 50), b.noise(3, 50))  # no hidden state: any order, any object
    assert not torch.equal(a.noise(3, 50), a.noise(4, 50))
    assert not torch.equal(a.noise(3, 50), CounterNoise(8).noise(3, 50))
    assert len({position_seed(s, t) for s in range(50) for t in range(50)}) == 2500
    assert all(0 <= position_seed(s, t) < 2 ** 63 for s in (-1, 0, 2 ** 70) for t in (0, 10 ** 6))


def test_the_race_samples_p_exactly_and_never_a_zero():
    draws = [CounterNoise(seed).sample(P, 11) for seed in range(4000)]
    assert 4 not in draws  # zero probability
    counts = [draws.count(v) for v in range(4)]
    assert chi_square(counts, P[:4].tolist()).p_value > 1e-3


def test_negative_control_a_uniform_race_fails():
    draws = []
    for seed in range(4000):
        u = torch.rand(5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        draws.append(int(sample_with_noise(P, u)))
    counts = [draws.count(v) for v in range(4)]
    assert chi_square(counts, P[:4].tolist()).p_value < 1e-3


def test_verify_equal_accepts_exactly_the_targets_choices():
    noise = CounterNoise(3)
    p = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    choices = [noise.sample(p[i], 20 + i) for i in range(4)]
    assert verify_equal(choices[:3], p, noise, 20) == (3, choices)  # all drafts are the target's: bonus too
    wrong = (choices[1] + 1) % 6
    assert verify_equal([choices[0], wrong, choices[2]], p, noise, 20) == (1, choices[:2])
    assert verify_equal([], p[:1], noise, 20) == (0, choices[:1])
    greedy = torch.nn.functional.one_hot(torch.tensor([2, 4]), 6).double()
    assert verify_equal([2], greedy, noise, 0, greedy=True) == (1, [2, 4])
    assert sample_token(greedy[1], noise, 5, greedy=True) == 4


@pytest.mark.parametrize("position", [0, 1, 10 ** 9])
def test_sample_token_dispatches(position):
    g = torch.Generator().manual_seed(1)
    assert sample_token(P, CounterNoise(5), position, False) == CounterNoise(5).sample(P, position)
    assert 0 <= sample_token(P, g, position, False) < 4
