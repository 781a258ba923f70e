"""Block verification (core/block.py): the law by enumeration, the batched rule against its
reference bit for bit, the paper's never-fewer-tokens guarantee, and negative controls."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from specdecode.core.block import verify_block, verify_block_reference
from specdecode.core.probs import SamplingParams
from specdecode.core.verify import Randomness
from tests.core.test_enumeration import PARAMS, round_law, speculative_joint
from tests.core.test_verify import check_batched_equals_reference, two_token_p_value
from tests.toy import ToyModel


def block_round_law(target: ToyModel, draft: ToyModel, ctx: tuple[int, ...], k: int,
                    weight_residual: bool = True, last_h_is_weight: bool = True) -> dict[tuple[int, ...], float]:
    """Exact law of one round of block verification, written from the paper's formulas (not from
    the module): for every draft x_1..x_K (probability prod q), tau = i with probability
    h_i * prod_{j>i} (1 - h_j), then y from the residual r_tau or the bonus row.
    The two flags break the rule on purpose for the negative controls."""
    out: dict[tuple[int, ...], float] = defaultdict(float)
    vocab = target.vocab
    for xs in itertools.product(range(vocab), repeat=k):
        q_rows = [draft.probs(ctx + xs[:i]) for i in range(k)]
        prob = 1.0
        for i, x in enumerate(xs):
            prob *= float(q_rows[i][x])
        if prob == 0:
            continue
        p_rows = [target.probs(ctx + xs[:i]) for i in range(k + 1)]
        weights = [1.0]
        for i, x in enumerate(xs):
            weights.append(min(1.0, weights[-1] * float(p_rows[i][x]) / float(q_rows[i][x])))

        def residual(i: int) -> torch.Tensor:  # r_i: at position i + 1, after keeping i drafts
            scale = weights[i] if weight_residual else 1.0
            return (scale * p_rows[i] - q_rows[i]).clamp_min(0)

        h = {}
        for i in range(1, k + 1):
            if i == k:
                h[i] = weights[k] if last_h_is_weight else 1.0
            else:
                mass = float(residual(i).sum())
                h[i] = mass / (mass + 1 - weights[i]) if mass + 1 - weights[i] > 0 else 0.0
        for tau in range(0, k + 1):
            p_tau = h[tau] if tau > 0 else 1.0
            for j in range(tau + 1, k + 1):
                p_tau *= 1 - h[j]
            if p_tau == 0:
                continue
            row = p_rows[k] if tau == k else residual(tau)
            row = row / row.sum() if row.sum() > 0 else p_rows[tau] / p_rows[tau].sum()
            for y in range(vocab):
                if row[y] > 0:
                    out[xs[:tau] + (y,)] += prob * p_tau * float(row[y])
    return out


def expected_tokens(law: dict[tuple[int, ...], float]) -> float:
    return sum(len(seq) * pr for seq, pr in law.items())


CASES = [("random", dict(), dict()), ("p-zeros", dict(zeros=True), dict()), ("q-zeros", dict(), dict(zeros=True)),
         ("both-zeros", dict(zeros=True), dict(zeros=True))]


@pytest.mark.parametrize("name, t_kw, d_kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.8-topk3", "topp0.7", "mixed", "greedy"])
@pytest.mark.parametrize("vocab, k", [(3, 1), (4, 2), (3, 3), (5, 2)])
def test_block_law_is_the_target_joint(name, t_kw, d_kw, params, vocab, k):
    target = ToyModel(vocab, seed=10 + vocab, params=params, **t_kw)
    draft = ToyModel(vocab, seed=20 + k, sharpness=1.0, params=params, **d_kw)
    law = lambda t, d, ctx, kk: block_round_law(t, d, ctx, kk)  # noqa: E731
    spec = speculative_joint(target, draft, k, k + 1, round_law=law)
    exact = target.joint(k + 1)
    for seq in itertools.product(range(vocab), repeat=k + 1):
        assert spec.get(seq, 0.0) == pytest.approx(exact[seq], abs=1e-12), seq


@pytest.mark.parametrize("vocab, k", [(3, 2), (4, 3)])
@pytest.mark.parametrize("params", PARAMS[:4], ids=["t1", "t0.8-topk3", "topp0.7", "mixed"])
def test_deterministic_drafts_under_sampling(vocab, k, params):
    """A deterministic drafter (lookup; one-hot q) verified against a sampled target."""
    target = ToyModel(vocab, seed=7, params=params, zeros=True)
    draft = ToyModel(vocab, seed=8, params=SamplingParams(temperature=0.0))
    law = lambda t, d, ctx, kk: block_round_law(t, d, ctx, kk)  # noqa: E731
    spec = speculative_joint(target, draft, k, k + 1, round_law=law)
    exact = target.joint(k + 1)
    for seq in itertools.product(range(vocab), repeat=k + 1):
        assert spec.get(seq, 0.0) == pytest.approx(exact[seq], abs=1e-12), seq


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_never_fewer_tokens_than_token_verification(seed, k):
    """The paper's guarantee: E[tokens per round] under block >= under token-by-token (equal for K = 1)."""
    target, draft = ToyModel(4, seed=seed), ToyModel(4, seed=100 + seed, sharpness=1.0)
    block = expected_tokens(block_round_law(target, draft, (), k))
    token = expected_tokens(round_law(target, draft, (), k))
    assert block >= token - 1e-12
    if k == 1:
        assert block == pytest.approx(token, abs=1e-12)


def test_block_gains_on_the_papers_example():
    """Sun et al.'s motivating example: V = {a, b}, p = (1/3, 2/3), q = (2/3, 1/3) in every context,
    K = 2: token verification accepts 10/9 drafts per round on average, block verification 11/9."""

    class Fixed(ToyModel):
        def __init__(self, probs):
            self.vocab, self._p = 2, torch.tensor(probs, dtype=torch.float64)

        def probs(self, ctx):
            return self._p

    p, q = Fixed([1 / 3, 2 / 3]), Fixed([2 / 3, 1 / 3])
    assert expected_tokens(round_law(p, q, (), 2)) - 1 == pytest.approx(10 / 9, abs=1e-12)
    assert expected_tokens(block_round_law(p, q, (), 2)) - 1 == pytest.approx(11 / 9, abs=1e-12)


@pytest.mark.parametrize("broken", [dict(weight_residual=False), dict(last_h_is_weight=False)],
                         ids=["residual-without-weight", "always-keep-the-whole-block"])
def test_enumeration_catches_broken_block_rules(broken):
    """Negative controls: the same comparison fails when a part of the rule is dropped."""
    target, draft = ToyModel(3, seed=13), ToyModel(3, seed=22, sharpness=1.0)
    law = lambda t, d, ctx, kk: block_round_law(t, d, ctx, kk, **broken)  # noqa: E731
    spec = speculative_joint(target, draft, 2, 3, round_law=law)
    exact = target.joint(3)
    assert max(abs(spec.get(seq, 0.0) - exact[seq]) for seq in exact) > 1e-3


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("deterministic", [False, True])
def test_batched_equals_reference_bit_for_bit(seed, deterministic):
    check_batched_equals_reference(verify_block, verify_block_reference, seed, deterministic)


def test_a_failed_test_does_not_end_the_block():
    """Unlike token verification, a later pass keeps the drafts before it: u_1 fails, u_2 passes."""
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]], dtype=torch.float64)
    q = torch.tensor([[[0.9, 0.1], [0.5, 0.5]]], dtype=torch.float64)
    draft = torch.tensor([[0, 0]])
    # P_1 = 5/9, r_1 = max(0, 5/18 - 1/2, 5/18 - 1/2) = 0 -> h_1 = 0; P_2 = 5/9 = h_2
    rand = Randomness(u=torch.tensor([[0.99, 0.5]], dtype=torch.float64), v=torch.full((1,), 0.5, dtype=torch.float64))
    assert int(verify_block(draft, q, p, rand).n_accepted[0]) == 2


def test_greedy_keeps_exactly_the_matching_prefix():
    p = torch.zeros(1, 4, 5, dtype=torch.float64)
    for i, a in enumerate([1, 2, 3, 4]):
        p[0, i, a] = 1.0
    rand = Randomness.draw(1, 3, torch.Generator().manual_seed(0))
    result = verify_block(torch.tensor([[1, 2, 0]]), None, p, rand)
    assert result.emitted(0) == [1, 2, 3]


@pytest.mark.parametrize("k", [1, 3])
def test_first_two_tokens_follow_target_joint(k):
    """Monte Carlo through the batched rule (chi-square, 16 cells; false-failure probability 1e-3 per
    case, fixed seeds): the same statistic that rejects the broken token rules in test_verify."""
    assert two_token_p_value(verify_block, SamplingParams(), k) > 1e-3
    assert two_token_p_value(verify_block, SamplingParams(temperature=0.7, top_k=3), k) > 1e-3
