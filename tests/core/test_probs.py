"""Probability processing: temperature, top-k, top-p, min-p, greedy; explicit-RNG sampling."""

import pytest
import torch

from specdecode.core.probs import (GREEDY, SamplingParams, exponential_noise, greedy_token, logits_to_probs, sample,
                                   sample_with_noise, sample_with_uniform)
from specdecode.stats import chi_square

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], dtype=torch.float64)


def test_temperature_one_is_softmax_and_scales():
    assert torch.allclose(logits_to_probs(LOGITS, SamplingParams()), torch.softmax(LOGITS, 0))
    assert torch.allclose(logits_to_probs(LOGITS, SamplingParams(temperature=0.5)), torch.softmax(LOGITS / 0.5, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1e-30, 1.2e-38, 5e-39, 1e-300, 5e-324])
def test_a_tiny_temperature_gives_the_limit_of_one_hot_top_not_nan(dtype, temperature):
    """As T -> 0 the law tends to the argmax (uniform over exact ties). A tiny T once gave NaN: logits / T
    overflowed (and below float32's smallest normal number, T itself rounded to 0)."""
    logits = torch.tensor([10.0, 30.0, 30.0, -20.0, float("-inf")], dtype=dtype)  # 30 / 1.2e-38 > float32 max
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    assert probs.dtype == dtype
    assert probs.tolist() == [0.0, 0.5, 0.5, 0.0, 0.0]
    distinct = logits_to_probs(LOGITS.to(dtype), SamplingParams(temperature=temperature, top_k=3, min_p=0.5))
    assert distinct.tolist() == logits_to_probs(LOGITS.to(dtype), GREEDY).tolist()


@pytest.mark.parametrize("top_p", [1e-45, 1e-300])
def test_a_top_p_below_float32s_range_keeps_the_top_token(top_p):
    """A top_p that rounds to 0 in float32 kept nothing (0 / 0: NaN); the most likely token always stays."""
    probs = logits_to_probs(LOGITS.float(), SamplingParams(top_p=top_p))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_greedy_is_one_hot_argmax():
    probs = logits_to_probs(LOGITS, GREEDY)
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert GREEDY.greedy and not SamplingParams().greedy


def test_top_k_keeps_k_most_likely():
    probs = logits_to_probs(LOGITS, SamplingParams(top_k=2))
    assert (probs > 0).tolist() == [True, True, False, False, False]
    assert probs.sum() == pytest.approx(1.0)
    assert probs[0] / probs[1] == pytest.approx(torch.exp(torch.tensor(1.0)).item())


def test_top_p_keeps_smallest_set_reaching_mass():
    base = torch.softmax(LOGITS, 0)  # ~[0.55, 0.20, 0.12, 0.07, 0.03]
    for top_p, kept in [(0.5, 1), (0.55, 1), (0.7, 2), (0.8, 3), (0.9, 4), (1.0, 5)]:
        probs = logits_to_probs(LOGITS, SamplingParams(top_p=top_p))
        n = int((probs > 0).sum())
        assert n == kept, (top_p, n)
        assert float(base[:n].sum()) >= top_p or n == 5
        assert float(base[: n - 1].sum()) < top_p


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    kept = sorted_probs * (torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p)
    return torch.zeros_like(probs).scatter(-1, order, kept / kept.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_top_p_over_growing_windows_is_the_full_sorts_set(dtype):
    """Top-p looks at the 64 most likely tokens first, then 512, 4096, all (a full sort of a 151,936-token row
    cost 12-14 ms): its set must be the full sort's, for peaked rows (the first window) and flat ones (all)."""
    from specdecode.core.probs import _top_p
    g = torch.Generator().manual_seed(7)
    for scale, vocab in [(8.0, 151_936), (3.0, 151_936), (0.5, 20_000), (0.01, 5_000), (2.0, 70)]:
        logits = torch.randn(3, vocab, generator=g, dtype=torch.float64) * scale
        logits[0, :10] = -float("inf")  # zeros in p
        probs = torch.softmax(logits, dim=-1).to(dtype)
        for top_p in (0.05, 0.5, 0.9, 0.999):
            assert torch.equal(_top_p(probs, top_p), _top_p_by_full_sort(probs, top_p)), (scale, vocab, top_p)
    tied = torch.full((2, 5_000), 1 / 5_000, dtype=dtype)  # all tied: which tokens is the sort's choice, how many is not
    for top_p in (0.05, 0.9):
        ours, full = _top_p(tied, top_p), _top_p_by_full_sort(tied, top_p)
        assert torch.equal((ours > 0).sum(-1), (full > 0).sum(-1)) and torch.allclose(ours.sum(-1), full.sum(-1))


def test_min_p():
    probs = logits_to_probs(LOGITS, SamplingParams(min_p=0.2))  # keep p >= 0.2 * 0.55
    base = torch.softmax(LOGITS, 0)
    assert ((probs > 0) == (base >= 0.2 * base.max())).all()
    assert probs.sum() == pytest.approx(1.0)


def test_batched_over_leading_dims_matches_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 17, generator=g, dtype=torch.float64)
    params = SamplingParams(temperature=0.7, top_k=9, top_p=0.9, min_p=0.01)
    batched = logits_to_probs(logits, params)
    for i in range(3):
        for j in range(4):
            assert torch.equal(batched[i, j], logits_to_probs(logits[i, j], params))


def test_bf16_logits_are_upcast():
    probs = logits_to_probs(LOGITS.to(torch.bfloat16), SamplingParams())
    assert probs.dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.2), "top_p"),
    (dict(min_p=-0.1), "min_p"),
])
def test_bad_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_logits():
    with pytest.raises(ValueError, match="NaN"):
        logits_to_probs(torch.tensor([0.0, float("nan")]), SamplingParams())
    with pytest.raises(ValueError, match="-inf"):
        logits_to_probs(torch.full((3,), float("-inf")), SamplingParams())
    with pytest.raises(ValueError, match="floating-point"):
        logits_to_probs(torch.tensor([1, 2]), SamplingParams())


def test_greedy_token_is_where_the_greedy_distribution_puts_its_mass():
    """A plain greedy step takes `greedy_token` instead of building the one-hot p: the same token
    (the first of tied maxima), in every dtype, and the same errors."""
    g = torch.Generator().manual_seed(3)
    rows = [LOGITS, torch.tensor([1.0, 4.0, 4.0, 0.0]), torch.tensor([-float("inf"), 0.5, float("inf")]),
            torch.randint(0, 3, (40,), generator=g).float(), torch.randn(151_936, generator=g).bfloat16(),
            torch.randn(2, 7, generator=g)[1, ::2]]
    for row in rows:
        assert greedy_token(row) == int(logits_to_probs(row, GREEDY).argmax()), row
    assert greedy_token(torch.tensor([1.0, 4.0, 4.0, 0.0])) == 1
    for bad, match in [(torch.tensor([0.0, float("nan")]), "NaN"), (torch.full((3,), float("-inf")), "-inf"),
                       (torch.tensor([1, 2]), "floating-point"), (torch.zeros(2, 3), "one row"),
                       (torch.zeros(0), "one row")]:
        with pytest.raises(ValueError, match=match):
            greedy_token(bad)
        if bad.dim() == 1 and len(bad):  # logits_to_probs refuses the same rows, in the same words
            with pytest.raises(ValueError, match=match):
                logits_to_probs(bad, GREEDY)


def test_sampling_is_reproducible_from_explicit_generator():
    probs = torch.softmax(LOGITS, 0).expand(1000, 5)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    c = sample(probs, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_inverse_cdf_law_and_negative_control():
    """sample() (inverse CDF) follows probs (chi-square); squared uniforms instead of uniforms are caught.

    False-failure probability: the correct sampler fails only if p-value < 1e-4,
    i.e. with probability 1e-4 (fixed seed: deterministic in practice).
    """
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64)
    n = 40_000
    g = torch.Generator().manual_seed(3)
    good = sample(probs.expand(n, 5), g)
    assert chi_square(torch.bincount(good, minlength=5).tolist(), probs.tolist()).p_value > 1e-4
    unnormalised = sample(3.0 * probs.expand(n, 5), g)  # weights need no normalisation
    assert chi_square(torch.bincount(unnormalised, minlength=5).tolist(), probs.tolist()).p_value > 1e-4
    bad = sample_with_uniform(probs.expand(n, 5), torch.rand(n, generator=g, dtype=torch.float64) ** 2)
    assert chi_square(torch.bincount(bad, minlength=5).tolist(), probs.tolist()).p_value < 1e-4


def test_inverse_cdf_never_picks_zero_weight_even_at_the_edges():
    weights = torch.tensor([[0.0, 0.6, 0.0, 0.4, 0.0]], dtype=torch.float64).expand(3, 5)
    u = torch.tensor([0.0, 0.6, 1.0 - 2 ** -53], dtype=torch.float64)
    assert sample_with_uniform(weights, u).tolist() == [1, 3, 3]
    assert sample_with_uniform(weights[:1], torch.tensor([1.0], dtype=torch.float64)).tolist() == [3]


def test_two_level_inverse_cdf_on_a_large_vocabulary():
    """Past 2,048 entries the inverse CDF runs in two levels (block totals, then one block): its
    law, with the weight at block edges and unnormalised, by chi-square (false-failure
    probability 1e-4; fixed seed), a squared-uniform control that must fail, the same index as
    one flat float64 cumulative sum on a dense row, and zero weights never picked at the edges."""
    support = [0, 1023, 1024, 3000, 4999]  # block edges (blocks of 1024), and the last entry
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64)
    weights = torch.zeros(5000, dtype=torch.float64)
    weights[support] = 3.0 * probs
    n = 40_000
    g = torch.Generator().manual_seed(5)
    counts = lambda idx: [int((idx == s).sum()) for s in support]  # noqa: E731
    good = sample(weights.expand(n, 5000), g)
    assert set(good.tolist()) <= set(support)
    assert chi_square(counts(good), probs.tolist()).p_value > 1e-4
    bad = sample_with_uniform(weights.expand(n, 5000), torch.rand(n, generator=g, dtype=torch.float64) ** 2)
    assert chi_square(counts(bad), probs.tolist()).p_value < 1e-4

    dense = torch.softmax(torch.randn(151_936, generator=g, dtype=torch.float64) * 3, 0)
    u = torch.rand(2000, generator=g, dtype=torch.float64)
    flat = torch.searchsorted(dense.cumsum(0), u * dense.sum(), right=True)
    assert torch.equal(sample_with_uniform(dense.expand(2000, -1), u), flat)

    edges = torch.zeros(3000, dtype=torch.float64)
    edges[[1500, 2047]] = 0.5
    u = torch.tensor([0.0, 0.5, 1.0 - 2 ** -53, 1.0], dtype=torch.float64)
    assert sample_with_uniform(edges.expand(4, -1), u).tolist() == [1500, 2047, 2047, 2047]


def test_exponential_race_law_and_negative_control():
    """sample_with_noise (reproducible sampling's sampler) follows probs; uniform noise instead
    of Exp(1) is caught. False-failure probability 1e-4 (fixed seed: deterministic in practice).
    """
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03], dtype=torch.float64)
    n = 40_000
    g = torch.Generator().manual_seed(3)
    good = sample_with_noise(probs.expand(n, 5), exponential_noise((n, 5), g))
    assert chi_square(torch.bincount(good, minlength=5).tolist(), probs.tolist()).p_value > 1e-4
    uniform_noise = torch.rand(n, 5, generator=g, dtype=torch.float64)
    bad = sample_with_noise(probs.expand(n, 5), uniform_noise)
    assert chi_square(torch.bincount(bad, minlength=5).tolist(), probs.tolist()).p_value < 1e-4


def test_zero_weights_never_sampled():
    probs = torch.tensor([0.0, 0.6, 0.0, 0.4], dtype=torch.float64).expand(5000, 4)
    tokens = sample(probs, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) <= {1, 3}


def test_greedy_sample_is_the_argmax_and_draws_no_noise():
    probs = logits_to_probs(torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]]), GREEDY)
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    assert sample(probs, g, greedy=True).tolist() == [1, 0]
    assert torch.equal(g.get_state(), state)  # the random stream is untouched
    assert sample(probs, torch.Generator().manual_seed(7)).tolist() == [1, 0]  # same as the noisy path


def test_argmax_is_torchs_first_maximum_with_nan_counting_as_the_maximum():
    """The numpy path (float32/float64 on the CPU) returns what torch.argmax returns: the first of tied
    maxima, the first NaN, 0 for a row of -inf; for strided views and batches; other dtypes go to torch."""
    from specdecode.core.probs import argmax

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, nan, nan], [-inf] * 5, [2.0, 2.0, 1.0, 0.0, 0.0], [0.0, -1.0, inf, inf, 5.0]])
    g = torch.Generator().manual_seed(0)
    cases = [rows, rows.double(), rows[:, ::2], rows.t(), rows[1], rows.bfloat16(),
             torch.randn(3, 2, 151_936, generator=g), torch.randint(0, 4, (6, 50), generator=g).float()]
    for x in cases:
        got = argmax(x)
        assert got.dtype == torch.long and torch.equal(got, torch.argmax(x, dim=-1)), x.shape
