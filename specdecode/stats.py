"""Goodness-of-fit helpers shared by the tests, the simulator report and the audits: chi-square against a
law and between two samples (cells merged to the usual expected counts), and the power of those tests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import optimize, stats


@dataclass(frozen=True, slots=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float | None  # None: no test was possible (the cells, merged until each expects 5, came down to one)
    samples: int
    categories: int  # after merging small ones
    test: str = "chi-square"  # or "fisher": a two-sample table that merged into one cell (chi_square_two_sample)


def chi_square(observed: Sequence[int], probs: Sequence[float], min_expected: float = 5.0) -> ChiSquare:
    """Pearson chi-square of counts against a distribution.

    Categories whose expected count is below `min_expected` are merged into one
    (the chi-square approximation needs ~5 expected per cell). A count observed in
    a category of probability 0 is an outright failure (p-value 0), so a law with one
    possible category is tested exactly: p-value 1 when every sample fell in it. Otherwise,
    too few samples for two cells is no test at all: p-value None, which no threshold passes
    or fails.
    """
    obs = np.asarray(observed, dtype=float)
    p = np.asarray(probs, dtype=float)
    if obs.shape != p.shape:
        raise ValueError(f"observed and probs differ in length: {obs.shape} vs {p.shape}")
    n = obs.sum()
    if n <= 0:
        raise ValueError("no samples")
    if (obs[p <= 0] > 0).any():
        return ChiSquare(float("inf"), 0, 0.0, int(n), int((p > 0).sum()))
    p = p / p.sum()
    exp = n * p
    cells = merge_small_cells(exp, min_expected)
    obs_m, exp_m = _merged(obs, cells), _merged(exp, cells)
    dof = len(exp_m) - 1
    if dof < 1:
        certain = int((p > 0).sum()) == 1  # every sample is where it must be: a pass at any n
        return ChiSquare(0.0, 0, 1.0 if certain else None, int(n), len(exp_m))
    statistic = float(((obs_m - exp_m) ** 2 / exp_m).sum())
    return ChiSquare(statistic, dof, float(stats.chi2.sf(statistic, dof)), int(n), len(exp_m))


def chi_square_two_sample(a: Sequence[int], b: Sequence[int], min_expected: float = 5.0) -> ChiSquare:
    """Pearson chi-square test that two samples, counted over the same cells, come from one law (the
    2 x k homogeneity table).

    Cells are merged as in `chi_square` until each side expects `min_expected` of them under the pooled
    law. A table that merges into one cell (one frequent outcome and rare others) is tested exactly:
    Fisher's test of (the most frequent cell, the rest). Both samples in one cell is a p-value of 1.
    `samples` counts both sides.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"the two samples' counts differ in length: {a.shape} vs {b.shape}")
    n_a, n_b = a.sum(), b.sum()
    if n_a <= 0 or n_b <= 0:
        raise ValueError("no samples on one side")
    a_m, b_m = two_sample_cells(a, b, min_expected)
    n = int(n_a + n_b)
    if len(a_m) >= 2:
        statistic, p_value, dof, _ = stats.chi2_contingency(np.vstack([a_m, b_m]), correction=False)
        return ChiSquare(float(statistic), int(dof), float(p_value), n, len(a_m))
    top = int(np.argmax(a + b))
    if a[top] + b[top] == n:  # every answer on both sides is the same outcome
        return ChiSquare(0.0, 0, 1.0, n, 1, "fisher")
    table = [[a[top], n_a - a[top]], [b[top], n_b - b[top]]]
    return ChiSquare(0.0, 1, float(stats.fisher_exact(table).pvalue), n, 2, "fisher")


def two_sample_cells(a: Sequence[int], b: Sequence[int], min_expected: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """Both samples' counts over the cells `chi_square_two_sample` tests: merged until each side expects
    `min_expected` in every cell under the pooled law."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    pooled = (a + b) / (a.sum() + b.sum())
    cells = merge_small_cells(min(a.sum(), b.sum()) * pooled, min_expected)
    return _merged(a, cells), _merged(b, cells)


def merge_small_cells(expected: np.ndarray, min_expected: float = 5.0) -> np.ndarray:
    """Which merged cell each cell counts in, for a chi-square test: a cell expecting `min_expected` or more
    keeps its own; the others are pooled into one; a pool that still expects fewer folds into the
    smallest kept cell (or, with none kept, is dropped: -1)."""
    expected = np.asarray(expected, dtype=float)
    big = expected >= min_expected
    cells = np.full(expected.shape, -1)
    cells[big] = np.arange(int(big.sum()))
    rest = float(expected[~big].sum())
    if rest >= min_expected:
        cells[~big] = int(big.sum())
    elif big.any():
        cells[~big] = int(np.argmin(np.where(big, expected, np.inf)[big]))
    return cells


def _merged(values: np.ndarray, cells: np.ndarray) -> np.ndarray:
    kept = cells >= 0
    return np.bincount(cells[kept], weights=values[kept], minlength=int(cells.max(initial=-1)) + 1)


def noncentrality_for_power(dof: int, level: float, power: float = 0.9) -> float:
    """The noncentrality at which a chi-square test of `dof` degrees of freedom at `level` rejects with
    probability `power` (its statistic is then noncentral chi-square)."""
    if dof < 1 or not 0 < level < 1 or not level < power < 1:
        raise ValueError(f"need dof >= 1 and 0 < level < power < 1, got {dof}, {level}, {power}")
    critical = stats.chi2.isf(level, dof)
    shortfall = lambda lam: stats.ncx2.sf(critical, dof, lam) - power  # noqa: E731
    high = 1.0
    while shortfall(high) < 0:
        high *= 2
    return float(optimize.brentq(shortfall, 1e-9, high, xtol=1e-6))


def detectable_tv(n_eff: float, dof: int, level: float, power: float = 0.9) -> float:
    """The smallest total-variation distance between two laws, over a test's cells, that the chi-square
    test detects with probability >= `power`, whatever the shape of the difference.

    n_eff: the samples (one-sample test against a law) or n_a n_b / (n_a + n_b) (two samples; n / 2 for
    n on each side). The statistic is noncentral chi-square with noncentrality n_eff * D, where
    D = sum_i (p_i - r_i)^2 / r_i (r: the law tested against, or the pooled one), and by Cauchy-Schwarz
    D >= (sum_i |p_i - r_i|)^2 = 4 TV^2, with equality for a difference proportional to r. So the test
    has that power wherever 4 TV^2 n_eff >= the noncentrality `noncentrality_for_power` gives."""
    if n_eff <= 0:
        raise ValueError(f"n_eff must be > 0, got {n_eff}")
    return min(1.0, 0.5 * math.sqrt(noncentrality_for_power(dof, level, power) / n_eff))


def samples_for_tv(tv: float, dof: int, level: float, power: float = 0.9, two_sample: bool = True) -> int:
    """Samples (on each side, for two samples) for `detectable_tv` to reach `tv`."""
    if not 0 < tv <= 1:
        raise ValueError(f"tv must be in (0, 1], got {tv}")
    n_eff = noncentrality_for_power(dof, level, power) / (4 * tv * tv)
    return math.ceil(2 * n_eff if two_sample else n_eff)
