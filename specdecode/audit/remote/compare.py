"""The tests of the black-box audit, on answers.

Under the null hypothesis (the endpoint's law equals the reference's), every function of an answer
has the same law on both sides, so each statistic below is a valid two-sample test:
- the first m tokens (the whole answer of a max_tokens = m request, its text and finish reason);
- the first j < m tokens, where the servers report the answer's tokens (logprobs);
- the boundary: where the answer ended (finish reason, completion tokens), for a longer max_tokens.
Where the reference reports its first token's probabilities (top_logprobs), the endpoint's first
tokens are also tested against them (one sample against a law: the power of twice the samples per
side; `detectable_tv` says how much), but only if the reference's own answers follow them (vLLM, for
one, reports the model's raw logprobs, before temperature and top-k, unless told otherwise).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Hashable, Sequence

from specdecode.audit.checks import law_check
from specdecode.audit.remote.client import Answer
from specdecode.audit.remote.plan import Group
from specdecode.audit.verdict import LevelTest
from specdecode.stats import chi_square_two_sample, detectable_tv, two_sample_cells

END = "<end>"  # an answer that ended before j tokens
LOGPROBS = "first token vs the reference's logprobs"


@dataclass(frozen=True, slots=True)
class Statistic:
    name: str
    of: Callable[[Answer], Hashable | None]  # None: this answer does not tell (no tokens reported)


def statistics(group: Group, tokens: bool) -> list[Statistic]:
    """The two-sample tests of a group; `tokens`: both servers report each answer's tokens."""
    if group.boundary:
        return [Statistic("end (finish reason, tokens)", _end)]
    whole = Statistic(f"first {group.max_tokens} tokens", lambda a: (a.text, a.finish_reason))
    return [Statistic(f"first {j} token{'s' * (j > 1)}", _first(j)) for j in range(1, group.max_tokens)
            if tokens] + [whole]


def _first(j: int) -> Callable[[Answer], Hashable | None]:
    def of(a: Answer):
        return None if a.tokens is None else tuple(a.tokens[:j]) + ((END,) if len(a.tokens) < j else ())
    return of


def _end(a: Answer):
    n = len(a.tokens) if a.tokens is not None else a.completion_tokens
    return None if n is None else (a.finish_reason, n)


@dataclass(frozen=True, slots=True)
class Comparison(LevelTest):
    """One test: the endpoint's answers against the reference's (two samples), or against the law the
    reference reports (logprobs)."""

    group: str  # the group's label (or the control's)
    statistic: str  # what of each answer it compares
    test: str  # "chi-square", "fisher" (a table that merged into one cell), "logprobs"
    samples: tuple[int, int]  # answers of the endpoint and of the reference that it used
    p_value: float | None  # None: not run (note says why)
    level: float  # fails when p_value < level
    cells: int  # after merging
    tv: float | None  # TV between the two sides' frequencies (or sample and law) over the test's cells
    detectable_tv: float | None  # the smallest TV over those cells detected with probability `power`
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.group}: {self.statistic}"


def two_sample(group: str, statistic: str, a: Sequence[Hashable], b: Sequence[Hashable], level: float,
               power: float) -> Comparison:
    """The chi-square test that outcomes `a` (endpoint) and `b` (reference) come from one law."""
    if not a or not b:
        return Comparison(group, statistic, "chi-square", (len(a), len(b)), None, level, 0, None, None,
                          "no answers on a side")
    keys = sorted(set(a) | set(b), key=repr)
    count_a, count_b = Counter(a), Counter(b)
    counts_a, counts_b = [count_a[k] for k in keys], [count_b[k] for k in keys]
    fit = chi_square_two_sample(counts_a, counts_b)
    cells_a, cells_b = two_sample_cells(counts_a, counts_b)
    if fit.test == "fisher":  # its cells: the most frequent outcome and the rest
        top = max(keys, key=lambda k: count_a[k] + count_b[k])
        cells_a, cells_b = [count_a[top], len(a) - count_a[top]], [count_b[top], len(b) - count_b[top]]
    tv = 0.5 * sum(abs(x / len(a) - y / len(b)) for x, y in zip(cells_a, cells_b))
    varied = fit.categories >= 2
    n_eff = len(a) * len(b) / (len(a) + len(b))
    return Comparison(group, statistic, fit.test, (len(a), len(b)), fit.p_value, level, fit.categories, tv,
                      detectable_tv(n_eff, max(fit.dof, 1), level, power) if varied else None,
                      "" if varied else "one outcome on both sides")


def against_law(group: str, endpoint_first: Sequence[str], reference_first: Sequence[str], law: dict[str, float] | None,
                level: float, power: float) -> Comparison:
    """The endpoint's first tokens (END for an answer without any) against the first-token law the
    reference reports (token -> logprob, its most likely tokens; the rest is one cell), if the
    reference's own first tokens follow it."""
    if not endpoint_first or not reference_first or not law:
        return Comparison(group, LOGPROBS, "logprobs", (len(endpoint_first), 0), None, level, 0, None, None,
                          "no answers" if law else "no reported first-token law")
    cells: dict[tuple[str], float] = {}
    for token, lp in law.items():  # a token of no text is the end (EOS), as an answer without tokens is
        key = (token or END,)
        cells[key] = cells.get(key, 0.0) + math.exp(lp)
    rest = max(0.0, 1.0 - sum(cells.values()))
    own = law_check(group, [(t,) for t in reference_first], cells, rest, level, 0.0)
    if not own.passed:
        return Comparison(group, LOGPROBS, "logprobs", (len(endpoint_first), 0), None, level, own.categories, None, None,
                          f"not run: the reference's own first tokens do not follow its logprobs (p = "
                          f"{own.p_value:.2g}), so they are not the law it samples (raw logprobs, before "
                          f"temperature or truncation?)")
    check = law_check(group, [(t,) for t in endpoint_first], cells, rest, level, 0.0)
    detectable = detectable_tv(check.samples, check.categories - 1, level, power) if check.categories >= 2 else None
    return Comparison(group, LOGPROBS, "logprobs", (check.samples, 0), check.p_value, level, check.categories, check.tv,
                      detectable, "" if check.tested else "too few samples for two cells")


def first_token_law(answers: Sequence[Answer]) -> dict[str, float] | None:
    """The first-token law (token -> logprob) the answers report: the first answer's top_logprobs at
    position 0 (every answer reports the same one, up to rounding)."""
    for a in answers:
        if a.top and a.top[0]:
            return a.top[0]
    return None


@dataclass(frozen=True, slots=True)
class GreedyCheck:
    """Greedy (temperature 0) answers of both sides to one prompt: identical, or where they diverge."""

    name: str
    result: str  # "identical", "numerics" (a near-tie), "loss", "unexplained" (no logprobs to tell)
    position: int | None  # the first token (or character, without tokens) that differs
    unit: str  # "token" or "character"
    margin: float | None  # the reference's logprob of its token minus of the endpoint's, there
    endpoint: str  # each side's text from the divergence on (its start)
    reference: str
    note: str

    @property
    def passed(self) -> bool:
        return self.result in ("identical", "numerics")


SHOWN = 24  # characters of each side shown from a divergence on
PROBE_SHARE = 0.2  # the tie probe: the share of its answers a branch within the tie margin takes, at least


def greedy_check(name: str, e: Answer, r: Answer, tie_margin: float) -> GreedyCheck:
    """A divergence within `tie_margin` of the reference's top two logprobs is numerics (batched kernels
    round near-ties differently), beyond it a loss; without logprobs it cannot be told."""
    if e.text == r.text:
        return GreedyCheck(name, "identical", None, "token", None, "", "", f"identical ({len(r.text)} characters)")
    if e.tokens is not None and r.tokens is not None:
        i = next((k for k, (x, y) in enumerate(zip(e.tokens, r.tokens)) if x != y), min(len(e.tokens), len(r.tokens)))
        e_rest, r_rest = "".join(e.tokens[i:])[:SHOWN], "".join(r.tokens[i:])[:SHOWN]
        top = r.top[i] if r.top is not None and i < len(r.top) else None
        if top is None or i >= len(e.tokens) or i >= len(r.tokens) or r.tokens[i] not in top:
            return GreedyCheck(name, "unexplained", i, "token", None, e_rest, r_rest,
                               f"diverged at token {i}, where the reference reports no logprobs of both tokens")
        known = e.tokens[i] in top
        margin = top[r.tokens[i]] - (top[e.tokens[i]] if known else min(top.values()))
        if not known and margin <= tie_margin:
            return GreedyCheck(name, "unexplained", i, "token", None, e_rest, r_rest,
                               f"diverged at token {i} to a token outside the reference's reported top tokens")
        if margin <= tie_margin:
            return GreedyCheck(name, "numerics", i, "token", margin, e_rest, r_rest,
                               f"diverged at token {i}, a near-tie: the top two logprobs differ by {margin:.3g} "
                               f"<= {tie_margin:g}")
        bound = "" if known else "at least "
        return GreedyCheck(name, "loss", i, "token", margin, e_rest, r_rest,
                           f"diverged at token {i} to a token {bound}{margin:.3g} below the reference's top logprob "
                           f"(> {tie_margin:g}): NOT a near-tie")
    i = next((k for k, (x, y) in enumerate(zip(e.text, r.text)) if x != y), min(len(e.text), len(r.text)))
    return GreedyCheck(name, "unexplained", i, "character", None, e.text[i:i + SHOWN], r.text[i:i + SHOWN],
                       f"diverged at character {i}; the servers report no logprobs, so a near-tie cannot be told "
                       f"from a loss")


def probe_temperature(tie_margin: float) -> float:
    """The temperature at which a branch `tie_margin` nats below the top one takes PROBE_SHARE of the answers
    (two candidates: 1 / (1 + exp(margin / T)) = PROBE_SHARE)."""
    return tie_margin / math.log((1 - PROBE_SHARE) / PROBE_SHARE)


def probe_answers(level: float) -> int:
    """Answers through the divergence that a branch within the tie margin misses with probability <= level."""
    return math.ceil(math.log(level) / math.log(1 - PROBE_SHARE))


def tie_probe(check: GreedyCheck, e: Answer, r: Answer, samples: Sequence[Answer], needed: int,
              temperature: float, tie_margin: float) -> GreedyCheck:
    """Tell a near-tie from a loss without logprobs: sampled at `temperature` (probe_temperature), the
    reference takes the endpoint's branch at the divergence in a share >= PROBE_SHARE of its answers
    through it if the two candidates are within `tie_margin` nats; a loss (a token far below the top)
    almost never. Seen once: numerics; unseen in `needed` answers through the divergence: a loss, with
    probability <= (1 - PROBE_SHARE)^needed of being a near-tie after all."""
    i = next((k for k, (x, y) in enumerate(zip(e.text, r.text)) if x != y), min(len(e.text), len(r.text)))
    branch = lambda text: text[i] if i < len(text) else END  # noqa: E731  (END: the answer stopped there)
    through = [a.text for a in samples if a.text.startswith(r.text[:i])]
    took = sum(branch(t) == branch(e.text) for t in through)
    where = f"diverged at {check.unit} {check.position}"
    at = f"at temperature {temperature:.3g} the reference takes the endpoint's branch"
    if took:
        return replace(check, result="numerics", note=f"{where}, a near-tie: {at} in {took} of {len(through)} "
                                                      f"answers through it")
    if len(through) >= needed:
        return replace(check, result="loss", note=f"{where}, NOT a near-tie: {at} in none of {len(through)} answers "
                                                  f"through it (a tie within {tie_margin:g} nats is taken in "
                                                  f"{PROBE_SHARE:.0%})")
    return replace(check, note=f"{check.note}; the tie probe had {len(through)} answers through it, {needed} needed")
