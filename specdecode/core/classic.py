"""Classic rejection sampling, the same idea as speculative verification (first document).

- rand7 from rand5: two calls make a uniform 1..25, keep 1..21 (a multiple of 7),
  reject the rest. Expected calls 2 * 25/21 = 50/21 ~ 2.381.
- the recycling version: a rejected value is itself uniform over the remainder
  (1..4), so it is reused with one more call (1..20, keep 14; remainder 1..6 ->
  1..30, keep 28; then fall back to the basic version): ~2.2156 calls.
  This mirrors resampling from the residual max(0, p - q) instead of throwing the
  target's forward pass away.
- von Neumann's fair coin from a biased one: HT -> heads, TH -> tails, else retry.
- the two-token world: q = [0.4, 0.6], p = [0.7, 0.3].

Sources are explicit objects that count their calls; no global RNG is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from specdecode.core.theory import acceptance_rate

RECYCLING_STAGES = 3  # as in the document: three levels, then fall back to the basic version


class UniformSource:
    """rand_n(): a uniform integer in 1..n from an explicit numpy Generator, counting calls."""

    def __init__(self, n: int, rng: np.random.Generator, block: int = 4096) -> None:
        self.n, self.rng, self.block = n, rng, block
        self.calls = 0
        self._buffer: list[int] = []

    def __call__(self) -> int:
        if not self._buffer:  # draw in blocks: one numpy call per `block` values
            self._buffer = self.rng.integers(1, self.n + 1, size=self.block).tolist()[::-1]
        self.calls += 1
        return self._buffer.pop()


class BiasedCoin:
    """A coin that lands heads (True) with probability `bias`, counting flips."""

    def __init__(self, bias: float, rng: np.random.Generator) -> None:
        if not 0.0 < bias < 1.0:
            raise ValueError(f"bias must be in (0, 1) for a fair coin to exist, got {bias}")
        self.bias, self.rng = bias, rng
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return bool(self.rng.random() < self.bias)


def rand7_basic(rand5: UniformSource) -> int:
    while True:
        val = 5 * (rand5() - 1) + rand5()  # uniform on 1..25
        if val <= 21:
            return (val - 1) % 7 + 1


def rand7_recycling(rand5: UniformSource) -> int:
    val, size = 5 * (rand5() - 1) + rand5(), 25  # val is uniform on 1..size
    for stage in range(RECYCLING_STAGES):
        keep = size - size % 7  # the largest multiple of 7 in range
        if val <= keep:
            return (val - 1) % 7 + 1
        if stage == RECYCLING_STAGES - 1:
            break
        # the rejected val - keep is uniform on 1..size-keep: reuse it as a high digit
        val, size = 5 * (val - keep - 1) + rand5(), 5 * (size - keep)
    return rand7_basic(rand5)


def expected_calls_basic() -> Fraction:
    """Two calls per attempt, an attempt succeeds with probability 21/25."""
    return 2 * Fraction(25, 21)


def expected_calls_recycling() -> Fraction:
    """Exact expectation for `rand7_recycling`, following its stages."""
    expected, reach, size = Fraction(2), Fraction(1), 25
    for stage in range(RECYCLING_STAGES):
        keep = size - size % 7
        reach *= Fraction(size - keep, size)  # probability of being rejected at this stage
        if stage == RECYCLING_STAGES - 1:
            expected += reach * expected_calls_basic()
        else:
            expected += reach  # one more call to extend the remainder
            size = 5 * (size - keep)
    return expected


def fair_coin(coin: BiasedCoin) -> bool:
    """von Neumann: flip twice; HT -> heads, TH -> tails, HH/TT -> retry."""
    while True:
        a, b = coin(), coin()
        if a != b:
            return a


def expected_flips_fair_coin(bias: float) -> float:
    """Two flips per attempt, success probability 2 b (1 - b)."""
    return 2 / (2 * bias * (1 - bias))


@dataclass(frozen=True, slots=True)
class OneTokenLaw:
    """Exact law of one speculative step for a single drafted token."""

    accept_prob: tuple[float, ...]  # min(1, p(x)/q(x)) per token
    alpha: float  # total acceptance probability = sum min(p, q)
    residual: tuple[float, ...]  # max(0, p - q) / (1 - alpha)
    emitted: tuple[float, ...]  # q(x) min(1, p/q) + (1 - alpha) residual(x)  (== p)


def one_token_law(p: torch.Tensor, q: torch.Tensor) -> OneTokenLaw:
    alpha = acceptance_rate(p, q)
    ratio = torch.where(q > 0, p / q.clamp_min(torch.finfo(q.dtype).tiny), torch.ones_like(p))
    accept = ratio.clamp(max=1.0)
    residual_mass = (p - q).clamp_min(0)
    residual = residual_mass / residual_mass.sum() if residual_mass.sum() > 0 else p
    emitted = q * accept + (1 - alpha) * residual
    return OneTokenLaw(tuple(accept.tolist()), alpha, tuple(residual.tolist()), tuple(emitted.tolist()))


def two_token_example() -> OneTokenLaw:
    """The document's world: tokens A, B with q = [0.4, 0.6] and p = [0.7, 0.3]."""
    return one_token_law(torch.tensor([0.7, 0.3], dtype=torch.float64),
                         torch.tensor([0.4, 0.6], dtype=torch.float64))
