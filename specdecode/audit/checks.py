"""The statistics of the audit: goodness of fit against an exact law, and a TV bound."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from specdecode.audit.verdict import LevelTest
from specdecode.stats import chi_square


@dataclass(frozen=True, slots=True)
class LawCheck(LevelTest):
    name: str
    samples: int
    p_value: float | None  # None: too few samples for a test (stats.chi_square)
    level: float  # reject (fail) when p_value < level
    tv: float  # empirical TV between the samples and the exact law
    tv_bound: float  # TV(engine law, exact law) <= tv_bound (<= 1) with probability >= 1 - level
    categories: int
    seconds: float


def law_check(name: str, samples: list, cells: dict, rest: float, level: float, seconds: float) -> LawCheck:
    """Compare samples (hashable outcomes) with exact cell probabilities plus a merged `rest` cell."""
    keys = list(cells)
    counts = Counter(s if s in cells else "rest" for s in samples)
    observed = [counts.get(k, 0) for k in keys] + [counts.get("rest", 0)]
    probs = [cells[k] for k in keys] + [rest]
    fit = chi_square(observed, probs)
    n = len(samples)
    tv = 0.5 * sum(abs(o / n - p) for o, p in zip(observed, probs))
    # TV is at most 1: with few samples over many cells the margin alone exceeds it (1.03, 1.26 were reported)
    bound = min(1.0, tv + tv_margin(n, fit.categories, level))
    return LawCheck(name, n, fit.p_value, level, tv, bound, fit.categories, seconds)


def tv_margin(n: int, categories: int, delta: float) -> float:
    """Half the L1 deviation bound of an empirical distribution (Weissman et al. 2003):
    P(||p_hat - p||_1 >= eps) <= (2^k - 2) exp(-n eps^2 / 2)."""
    k = max(categories, 2)
    log_terms = math.log(2 ** k - 2) if k < 60 else k * math.log(2)
    return 0.5 * math.sqrt(2 * (log_terms - math.log(delta)) / n)
