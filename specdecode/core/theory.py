"""The acceptance-rate mathematics of speculative decoding, as in the documents.

alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)
P(N = i) = alpha^(i-1) (1 - alpha) for i <= K,  P(N = K+1) = alpha^K
E[N] = (1 - alpha^(K+1)) / (1 - alpha)                       (K + 1 when alpha = 1)
speedup = E[N] * c / (c + K),   c = T_target / T_draft       (verification ~ one decode step)

Beyond the documents: verification is not flat in K on every machine, so
`CostModel` carries a measured verification-cost curve and the speedup becomes
E[N] * T_verify(1) / (T_verify(K+1) + K * T_draft). With a flat curve it reduces
to the formula above. K = 0 (no speculation) always has speedup 1, so the
optimal K is 0 whenever speculation does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode.checks import integer


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> float:
    """alpha = sum_x min(p(x), q(x)) for two distributions over the same vocabulary."""
    _check_pair(p, q)
    return float(torch.minimum(p, q).sum())


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> float:
    """TV(p, q) = 1/2 sum_x |p(x) - q(x)|."""
    _check_pair(p, q)
    return float((p - q).abs().sum() / 2)


def tokens_per_round_pmf(alpha: float, k: int) -> list[float]:
    """[P(N=1), ..., P(N=K+1)]: tokens emitted by one round with K drafts."""
    _check_alpha(alpha)
    _check_k(k, minimum=0)
    return [alpha ** (i - 1) * (1 - alpha) for i in range(1, k + 1)] + [alpha ** k]


def expected_tokens(alpha: float, k: int) -> float:
    """E[N] = (1 - alpha^(K+1)) / (1 - alpha); K + 1 at alpha = 1; 1 at K = 0."""
    _check_alpha(alpha)
    _check_k(k, minimum=0)
    return _expected_tokens(alpha, k)


def _expected_tokens(alpha: float, k: int) -> float:
    """`expected_tokens` unchecked: the inner loop of `CostModel.optimal_k`, run every round."""
    if alpha == 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def speedup(alpha: float, c: float, k: int) -> float:
    """Wall-clock speedup E[N] * c / (c + K) with verification costing one decode step."""
    return CostModel.flat(c).speedup(alpha, k)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-round costs in any consistent unit (seconds, or multiples of one target step).

    t_draft:  time for the drafter to propose one token.
    t_verify: t_verify[n-1] = time of one target pass over n tokens (n = 1 is a
              plain decode step). Must cover n = 1..K+1 for the K asked about.
    t_setup:  a fixed cost of drafting at all this round (K >= 1), e.g. a draft model
              catching up on text emitted while it sat out; 0 in the documents' model.
    """

    t_draft: float
    t_verify: tuple[float, ...]
    t_setup: float = 0.0

    def __post_init__(self) -> None:
        if not self.t_verify or any(t <= 0 for t in self.t_verify):
            raise ValueError("t_verify must be a non-empty sequence of positive times (index 0 = 1 token)")
        if self.t_draft < 0 or self.t_setup < 0:
            raise ValueError(f"t_draft and t_setup must be >= 0, got {self.t_draft}, {self.t_setup}")

    @staticmethod
    def flat(c: float, max_k: int = 64) -> "CostModel":
        """The documents' model: verification costs one decode step (= 1), a draft step 1/c."""
        if not c > 0:
            raise ValueError(f"c = T_target / T_draft must be > 0, got {c}")
        return CostModel(t_draft=1.0 / c, t_verify=(1.0,) * (max_k + 1))

    @staticmethod
    def measured(t_draft: float, t_verify: Sequence[float], t_setup: float = 0.0) -> "CostModel":
        return CostModel(t_draft=float(t_draft), t_verify=tuple(float(t) for t in t_verify), t_setup=float(t_setup))

    @property
    def max_k(self) -> int:
        return len(self.t_verify) - 1

    @property
    def c(self) -> float:
        """T_target / T_draft (inf for a free drafter)."""
        return self.t_verify[0] / self.t_draft if self.t_draft > 0 else float("inf")

    def round_time(self, k: int) -> float:
        """T_verify(K+1 tokens) + K * T_draft (+ t_setup if K >= 1); K = 0 is a plain decode step."""
        _check_k(k, minimum=0)
        if k > self.max_k:
            raise ValueError(f"the cost curve covers K <= {self.max_k}, asked for K={k}")
        return self._round_time(k)

    def _round_time(self, k: int) -> float:
        return self.t_verify[k] + k * self.t_draft + (self.t_setup if k else 0.0)

    def speedup(self, alpha: float, k: int) -> float:
        """Expected tokens per unit time relative to plain decoding."""
        _check_alpha(alpha)
        self.round_time(k)  # checks k
        return self._speedup(alpha, k)

    def _speedup(self, alpha: float, k: int) -> float:
        return _expected_tokens(alpha, k) * self.t_verify[0] / self._round_time(k)

    def optimal_k(self, alpha: float, k_max: int | None = None) -> int:
        """The integer K in 0..k_max maximising speedup (0 = do not speculate). Checked once, then
        `_speedup` unchecked for each K: adaptive K asks this a few times every round."""
        _check_alpha(alpha)
        if k_max is not None and (integer(k_max) is None or k_max < 0):
            raise ValueError(f"k_max must be an integer >= 0, got {k_max!r}")
        k_max = self.max_k if k_max is None else min(k_max, self.max_k)
        return max(range(k_max + 1), key=lambda k: (self._speedup(alpha, k), -k))


def optimal_k(alpha: float, c: float, k_max: int = 16) -> int:
    """argmax over integer K in 0..k_max of c/(c+K) * (1 - alpha^(K+1)) / (1 - alpha)."""
    return CostModel.flat(c, k_max).optimal_k(alpha)


def break_even_alpha(k: int, c: float, tol: float = 1e-12) -> float | None:
    """The alpha at which E[N] = 1 + K/c, i.e. speedup = 1 (bisection; E[N] rises with alpha); None where
    even alpha = 1 loses (E[N] = K + 1 < 1 + K/c, i.e. c < 1: a draft step dearer than the target's)."""
    _check_k(k, minimum=1)
    if not c > 0:
        raise ValueError(f"c must be > 0, got {c}")
    target, perfect = 1 + k / c, expected_tokens(1.0, k)
    if perfect < target:
        return None  # even perfect drafts do not pay for themselves
    if perfect == target:
        return 1.0  # only perfect drafts break even
    lo, hi = 0.0, 1.0
    while hi - lo > tol * hi:  # relative: at c = 1e12 the answer is ~1e-12, which an absolute 1e-12 missed
        mid = (lo + hi) / 2
        if mid in (lo, hi):  # the floats between them are exhausted
            break
        lo, hi = (mid, hi) if expected_tokens(mid, k) < target else (lo, mid)
    return (lo + hi) / 2


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def _check_k(k: int, minimum: int) -> None:
    if integer(k) is None or k < minimum:
        raise ValueError(f"K must be an integer >= {minimum}, got {k!r}")


def _check_pair(p: torch.Tensor, q: torch.Tensor) -> None:
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    for name, d in (("p", p), ("q", q)):
        bad = bool(torch.isnan(d).any() or (d < 0).any())
        if bad or abs(float(d.sum()) - 1) > 1e-6:
            found = "holds a negative or NaN entry" if bad else f"sums to {float(d.sum()):.6g}"
            raise ValueError(f"{name} must be a probability vector (non-negative, sums to 1); it {found}")
