"""Goodness-of-fit helpers shared by the tests, the simulator report and the audit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats


@dataclass(frozen=True, slots=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float | None  # None: no test was possible (the cells, merged until each expects 5, came down to one)
    samples: int
    categories: int  # after merging small ones


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
    big = exp >= min_expected
    obs_m = np.append(obs[big], obs[~big].sum())
    exp_m = np.append(exp[big], exp[~big].sum())
    if exp_m[-1] < min_expected:  # fold a still-small tail into the smallest big cell
        if len(exp_m) > 1:
            i = int(np.argmin(exp_m[:-1]))
            obs_m[i] += obs_m[-1]
            exp_m[i] += exp_m[-1]
        obs_m, exp_m = obs_m[:-1], exp_m[:-1]
    keep = exp_m > 0
    obs_m, exp_m = obs_m[keep], exp_m[keep]
    dof = len(exp_m) - 1
    if dof < 1:
        certain = int((p > 0).sum()) == 1  # every sample is where it must be: a pass at any n
        return ChiSquare(0.0, 0, 1.0 if certain else None, int(n), len(exp_m))
    statistic = float(((obs_m - exp_m) ** 2 / exp_m).sum())
    return ChiSquare(statistic, dof, float(stats.chi2.sf(statistic, dof)), int(n), len(exp_m))
