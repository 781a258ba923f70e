"""The verification rule: greedy tables, batched == reference, guards, bad input, and its law."""

from __future__ import annotations

import pytest
import torch

from specdecode.core.probs import SamplingParams, sample, sample_with_uniform
from specdecode.core.verify import Randomness, VerifyResult, verify, verify_reference
from specdecode.stats import chi_square
from tests.toy import ToyModel

V = 6


def one_hot(tokens: list[int], vocab: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).to(torch.float64)


def greedy_verify(draft: list[int], target_argmax: list[int]) -> list[int]:
    p = one_hot(target_argmax).unsqueeze(0)
    rand = Randomness.draw(1, len(draft), torch.Generator().manual_seed(0))
    return verify(torch.tensor([draft]), None, p, rand).emitted(0)


@pytest.mark.parametrize("draft, target, emitted", [
    ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted -> bonus
    ([5, 2, 3], [1, 2, 3, 4], [1]),  # first mismatch -> correction only
    ([1, 5, 3], [1, 2, 3, 4], [1, 2]),  # mismatch in the middle
    ([1, 2, 5], [1, 2, 3, 4], [1, 2, 3]),  # mismatch at the end
    ([0], [0, 0], [0, 0]),  # K = 1
])
def test_greedy_table(draft, target, emitted):
    assert greedy_verify(draft, target) == emitted


def random_case(g: torch.Generator, B: int, K: int, vocab: int = V, zeros: bool = True):
    p = torch.softmax(torch.randn(B, K + 1, vocab, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(B, K, vocab, generator=g, dtype=torch.float64) * 2, -1)
    if zeros:  # exact zeros in p and q, as top-k/top-p make them
        p = p * (torch.rand(p.shape, generator=g) > 0.3)
        p[..., 0] += 1e-3
        p = p / p.sum(-1, keepdim=True)
        q = q * (torch.rand(q.shape, generator=g) > 0.3)
        q[..., 1] += 1e-3
        q = q / q.sum(-1, keepdim=True)
    draft = sample(q, g)
    return draft, q, p


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("deterministic", [False, True])
def test_batched_equals_reference_bit_for_bit(seed, deterministic):
    check_batched_equals_reference(verify, verify_reference, seed, deterministic)


def check_batched_equals_reference(rule, reference, seed: int, deterministic: bool) -> None:
    """`rule` on a random batch (ragged lengths, zeros, p == q on some rows) equals `reference`
    row by row, bit for bit, with the same randomness."""
    g = torch.Generator().manual_seed(seed)
    B, K = 32, 1 + seed % 5
    draft, q, p = random_case(g, B, K)
    if seed % 3 == 0:
        p[: B // 2, :K] = q[: B // 2]  # p == q on some rows: residual guard territory
    lengths = torch.randint(1, K + 1, (B,), generator=g)
    rand = Randomness.draw(B, K, g)
    qq = None if deterministic else q
    result = rule(draft, qq, p, rand, lengths)
    for b in range(B):
        L = int(lengths[b])
        ref = reference(draft[b, :L].tolist(), None if qq is None else q[b, :L], p[b, : L + 1],
                        rand.u[b, :L], rand.v[b])
        assert result.emitted(b) == ref, b
        assert (result.tokens[b, L + 1:] == -1).all()


def test_one_hot_q_path_equals_explicit_one_hot():
    g = torch.Generator().manual_seed(5)
    B, K = 64, 4
    draft, _, p = random_case(g, B, K)
    rand = Randomness.draw(B, K, g)
    explicit = torch.nn.functional.one_hot(draft, V).to(torch.float64)
    a, b = verify(draft, None, p, rand), verify(draft, explicit, p, rand)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.n_accepted, b.n_accepted)


def test_q_zero_rejects_without_nan():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]], dtype=torch.float64)
    q = torch.tensor([[[1.0, 0.0, 0.0]]], dtype=torch.float64)  # token 1 has q = 0 but was "drafted"
    rand = Randomness(u=torch.zeros(1, 1, dtype=torch.float64), v=torch.full((1,), 0.5, dtype=torch.float64))
    result = verify(torch.tensor([[1]]), q, p, rand)
    assert int(result.n_accepted[0]) == 0
    assert result.emitted(0) == [1]  # residual max(0, p - q) = [0, .5, 0]


def test_p_equal_q_residual_guard():
    p = torch.tensor([[[0.3, 0.7], [0.5, 0.5]]], dtype=torch.float64)
    q = p[:, :1].clone()
    # force a rejection despite p == q (u * q < p fails only for u >= 1, so feed u = 1)
    rand = Randomness(u=torch.ones(1, 1, dtype=torch.float64), v=torch.full((1,), 0.5, dtype=torch.float64))
    result = verify(torch.tensor([[1]]), q, p, rand)
    assert int(result.n_accepted[0]) == 0
    assert result.emitted(0) == [1]  # falls back to p ([0.3, 0.7] read at v = 0.5), no NaN


def test_p_zero_never_accepted_even_with_u_zero():
    p = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]], dtype=torch.float64)
    q = torch.tensor([[[0.5, 0.5]]], dtype=torch.float64)
    rand = Randomness(u=torch.zeros(1, 1, dtype=torch.float64), v=torch.full((1,), 0.5, dtype=torch.float64))
    assert verify(torch.tensor([[1]]), q, p, rand).emitted(0) == [0]


def test_accept_test_is_float64_for_float32_p():
    """P(u < r) = r needs u compared at full precision: a u just below r = p(x) = 0.5 must be
    accepted even when p is float32 (rounded to float32, u becomes 0.5 and 0.5 < 0.5 fails),
    and a u just above r must be rejected. Batched and reference agree."""
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]], dtype=torch.float32)
    v = torch.full((1,), 0.5, dtype=torch.float64)
    for u, accepted in [(0.5 - 2.0 ** -40, True), (0.5 + 2.0 ** -40, False)]:
        u_t = torch.tensor([[u]], dtype=torch.float64)
        n = int(verify(torch.tensor([[1]]), None, p, Randomness(u_t, v)).n_accepted[0])
        assert n == int(accepted), u
        ref = verify_reference([1], None, p[0], u_t[0], v[0])
        assert (len(ref) == 2) == accepted, u


def test_rows_are_independent_of_the_batch():
    """No normalisation across the batch: a row's result does not depend on its neighbours."""
    g = torch.Generator().manual_seed(11)
    B, K = 16, 3
    draft, q, p = random_case(g, B, K)
    rand = Randomness.draw(B, K, g)
    full = verify(draft, q, p, rand)
    for b in range(B):
        s = slice(b, b + 1)
        alone = verify(draft[s], q[s], p[s], Randomness(rand.u[s], rand.v[s]))
        assert alone.emitted(0) == full.emitted(b)


def bad_call(**over):
    g = torch.Generator().manual_seed(0)
    draft, q, p = random_case(g, 2, 3, zeros=False)
    args = dict(draft_tokens=draft, q=q, p=p, rand=Randomness.draw(2, 3, g), lengths=None)
    args.update(over)
    return lambda: verify(**args)


@pytest.mark.parametrize("call, match", [
    (bad_call(p=torch.full((2, 3, V), 1 / V, dtype=torch.float64)), "p must be"),
    (bad_call(q=torch.full((2, 3, V + 1), 1 / (V + 1), dtype=torch.float64)), "q must be"),
    (bad_call(draft_tokens=torch.zeros(2, 0, dtype=torch.long), p=torch.full((2, 1, V), 1 / V),
              q=None), "K must be >= 1"),
    (bad_call(p=torch.full((2, 4, V), 0.5, dtype=torch.float64)), "sum to 1"),
    (bad_call(q=torch.full((2, 3, V), float("nan"), dtype=torch.float64)), "NaN"),
    (bad_call(lengths=torch.tensor([0, 3])), "lengths"),
    (bad_call(draft_tokens=torch.tensor([[0, 1, V], [0, 1, 2]])), "token ids"),
    (bad_call(rand=Randomness(torch.zeros(2, 2), torch.zeros(2))), "randomness u"),
    (bad_call(rand=Randomness(torch.zeros(2, 3), torch.zeros(2, V))), "randomness v"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---- the law of the emitted tokens, by Monte Carlo, with negative controls -------------------

def always_accept(draft, q, p, rand, lengths=None) -> VerifyResult:
    """Broken on purpose: accepts every draft and takes the bonus token."""
    B, K = draft.shape
    bonus = sample_with_uniform(p[:, K], rand.v)
    return VerifyResult(torch.full((B,), K), torch.cat([draft, bonus[:, None]], 1))


def residual_is_p(draft, q, p, rand, lengths=None) -> VerifyResult:
    """Broken on purpose: on rejection resamples from p instead of max(0, p - q)."""
    B, K = draft.shape
    res = verify(draft, q, p, rand)
    n = res.n_accepted
    rows = torch.arange(B)
    tokens = res.tokens.clone()
    tokens[rows, n] = sample_with_uniform(p[rows, n], rand.v)
    return VerifyResult(n, tokens)


def first_two_tokens(rule, target: ToyModel, draft: ToyModel, k: int, n: int, seed: int) -> list[tuple[int, int]]:
    """Run rounds of `rule` from the empty context until every sequence has 2 tokens."""
    g = torch.Generator().manual_seed(seed)
    ctxs: list[tuple[int, ...]] = [()] * n
    while True:
        todo = [i for i, c in enumerate(ctxs) if len(c) < 2]
        if not todo:
            return [c[:2] for c in ctxs]
        B = len(todo)
        drafts = torch.zeros(B, k, dtype=torch.long)
        q = torch.zeros(B, k, target.vocab, dtype=torch.float64)
        for j in range(k):
            q[:, j] = torch.stack([draft.probs(ctxs[i] + tuple(drafts[r, :j].tolist())) for r, i in enumerate(todo)])
            drafts[:, j] = sample(q[:, j], g)
        p = torch.stack([torch.stack([target.probs(ctxs[i] + tuple(drafts[r, :j].tolist())) for j in range(k + 1)])
                         for r, i in enumerate(todo)])
        result = rule(drafts, q, p, Randomness.draw(B, k, g))
        for r, i in enumerate(todo):
            ctxs[i] = ctxs[i] + tuple(result.emitted(r))


def two_token_p_value(rule, params: SamplingParams, k: int, seed: int = 0, n: int = 6000) -> float:
    target = ToyModel(4, seed=1, params=params)
    draft = ToyModel(4, seed=2, sharpness=1.0, params=params)
    joint = target.joint(2)
    keys = sorted(joint)
    pairs = first_two_tokens(rule, target, draft, k, n, seed)
    counts = {key: 0 for key in keys}
    for pair in pairs:
        counts[pair] += 1
    return chi_square([counts[key] for key in keys], [joint[key] for key in keys]).p_value


SETTINGS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=3), SamplingParams(top_p=0.8)]


@pytest.mark.parametrize("params", SETTINGS, ids=["t1", "t0.7-topk3", "topp0.8"])
@pytest.mark.parametrize("k", [1, 3])
def test_first_two_tokens_follow_target_joint(params, k):
    """Chi-square of the first two emitted tokens (16 cells) against p(y1) p(y2 | y1).

    False-failure probability: 1e-3 per case (threshold on the p-value); seeds are fixed,
    so the outcome is deterministic and was checked once.
    """
    assert two_token_p_value(verify, params, k) > 1e-3


@pytest.mark.parametrize("broken", [always_accept, residual_is_p], ids=["always-accept", "residual-is-p"])
def test_negative_controls_are_caught(broken):
    """The same statistic must reject broken rules (power check), at the same 1e-3 level."""
    assert two_token_p_value(broken, SamplingParams(), k=3) < 1e-3


def test_randomness_is_k_uniforms_and_one_for_the_last_sample():
    """A round consumes K + 1 uniforms of the sequence's generator, nothing V-sized (an exponential
    race over Qwen's 151,936 tokens cost 3.6 ms a round): u for the accept tests, v for the one
    residual/bonus sample, read from the residual's cumulative sum."""
    before, after = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    rand = Randomness.draw(2, 3, after)
    expected = torch.rand((2, 4), generator=before, dtype=torch.float64)
    assert torch.equal(rand.u, expected[:, :3]) and torch.equal(rand.v, expected[:, 3])
    assert torch.equal(torch.rand(4, generator=before), torch.rand(4, generator=after))  # nothing more consumed

    # v reads the residual's inverse CDF: rejected draft 0 under q one-hot leaves max(0, p - q) =
    # [0, .2, 0, .3] (unnormalised); v below 0.4 of it picks token 1, above picks token 3
    p = torch.tensor([[[0.5, 0.2, 0.0, 0.3], [0.25] * 4]], dtype=torch.float64)
    for v, token in [(0.0, 1), (0.39, 1), (0.41, 3), (1 - 2.0 ** -50, 3)]:
        rand = Randomness(u=torch.ones(1, 1, dtype=torch.float64), v=torch.tensor([v], dtype=torch.float64))
        assert verify(torch.tensor([[0]]), None, p, rand).emitted(0) == [token], v
