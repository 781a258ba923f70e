"""Exactness by enumeration: the rule's law of the emitted tokens equals the target's joint.

For a context-dependent target p(. | ctx) and draft q(. | ctx) over V <= 6 tokens and
K <= 3, `round_law` sums over every draft outcome (x_i ~ q, accepted with min(1, p/q),
else one token from the normalised residual max(0, p - q); the bonus from p after K
acceptances). Rounds are repeated until L = K + 1 tokens exist, and the exact law of
those L tokens must equal p(y_1) p(y_2 | y_1) ... p(y_L | ...) to 1e-12 in float64.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from specdecode.core.probs import SamplingParams
from tests.toy import ToyModel


def round_law(target: ToyModel, draft: ToyModel, ctx: tuple[int, ...], k: int) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens emitted by one round from `ctx` with K drafts."""
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def step(prefix: tuple[int, ...], depth: int, prob: float) -> None:
        p = target.probs(ctx + prefix)
        if depth == k:  # all K accepted: bonus token from p
            for y in range(target.vocab):
                if p[y] > 0:
                    out[prefix + (y,)] += prob * float(p[y])
            return
        q = draft.probs(ctx + prefix)
        residual = (p - q).clamp_min(0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        for x in range(target.vocab):
            if q[x] == 0:
                continue
            accept = min(1.0, float(p[x] / q[x]))
            if accept > 0:
                step(prefix + (x,), depth + 1, prob * float(q[x]) * accept)
            if accept < 1:
                for y in range(target.vocab):
                    if residual[y] > 0:
                        out[prefix + (y,)] += prob * float(q[x]) * (1 - accept) * float(residual[y])

    step((), 0, 1.0)
    return out


def speculative_joint(target: ToyModel, draft: ToyModel, k: int, length: int,
                      round_law=round_law) -> dict[tuple[int, ...], float]:
    """Exact law of the first `length` tokens when rounds (`round_law`: one round's law) are
    repeated until that many exist."""
    done: dict[tuple[int, ...], float] = defaultdict(float)
    frontier = {(): 1.0}
    while frontier:
        nxt: dict[tuple[int, ...], float] = defaultdict(float)
        for ctx, prob in frontier.items():
            for emitted, pr in round_law(target, draft, ctx, k).items():
                seq = ctx + emitted
                (done if len(seq) >= length else nxt)[seq[:length] if len(seq) >= length else seq] += prob * pr
        frontier = nxt
    return done


CASES = [
    ("random", dict(), dict()),
    ("p-zeros", dict(zeros=True), dict()),
    ("q-zeros", dict(), dict(zeros=True)),
    ("both-zeros", dict(zeros=True), dict(zeros=True)),
]
PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, top_k=3), SamplingParams(top_p=0.7),
          SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05), SamplingParams(temperature=0.0)]


@pytest.mark.parametrize("name, t_kw, d_kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.8-topk3", "topp0.7", "mixed", "greedy"])
@pytest.mark.parametrize("vocab, k", [(3, 1), (4, 2), (3, 3), (6, 2)])
def test_law_of_first_tokens_is_the_target_joint(name, t_kw, d_kw, params, vocab, k):
    target = ToyModel(vocab, seed=10 + vocab, params=params, **t_kw)
    draft = ToyModel(vocab, seed=20 + k, sharpness=1.0, params=params, **d_kw)
    length = k + 1
    exact = target.joint(length)
    spec = speculative_joint(target, draft, k, length)
    for seq in itertools.product(range(vocab), repeat=length):
        assert spec.get(seq, 0.0) == pytest.approx(exact[seq], abs=1e-12), seq


def test_p_equal_q_accepts_everything():
    target = ToyModel(4, seed=3)
    law = round_law(target, target, (), 3)
    assert all(len(seq) == 4 for seq in law)  # every round emits K + 1 tokens
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-12)


def test_enumeration_catches_a_broken_rule():
    """Negative control: the same comparison fails when the residual is replaced by p."""
    target, draft = ToyModel(3, seed=1), ToyModel(3, seed=2, sharpness=1.0)
    real_probs = target.probs

    broken = defaultdict(float)
    for x in range(3):  # one round, K = 1, residual replaced by p
        p, q = real_probs(()), draft.probs(())
        a = min(1.0, float(p[x] / q[x]))
        for y in range(3):
            broken[(y,)] += float(q[x]) * (1 - a) * float(p[y])
        broken[(x,)] += float(q[x]) * a
    exact = target.joint(1)
    assert max(abs(broken[s] - exact[s]) for s in exact) > 1e-3
