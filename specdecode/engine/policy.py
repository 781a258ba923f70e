"""How many tokens to draft each round: fixed K, or adaptive K from the measured cost model.

Adaptive K maximises expected emitted tokens per second,

    K* = argmax_K  E[N](alpha, K) / (T_verify(K+1) + K * T_draft),     K = 0 allowed,

the documents' optimal-K formula generalised to the measured verification-cost
curve (`core.theory.CostModel`). It estimates:
- T_verify(n), a round of n tokens without its drafting (the target pass over n tokens,
  then the probabilities, sampling and verification on its logits: engine/calibration.py's
  `time_pass`), and each drafter's step time, measured once in interleaved sweeps
  (`calibrate`, at the first request) and then kept fixed;
- alpha per drafter, a running estimate from per-position accepted/tested counts with
  a Beta-like prior (so early rounds behave) and exponential forgetting (so it tracks
  the text), restarted at every request (`begin`). A free drafter (prompt lookup, the
  suffix drafter: no model, one-hot q) also reports the first token it would have
  drafted in rounds where it did not draft; the target's p there is the probability the
  rule would have accepted it, so its estimate keeps tracking the text at no cost,
  where the draft model must be re-tested with real drafts now and then. A drafter that
  reports a situation per round gets an estimate per situation: prompt lookup's match
  length class (a 2-token coincidence is copied right far less often than a 16-token
  shared history), so long matches draft and short ones do not. A class starts at the
  acceptance the drafter measured for it (`Situation.prior`), else neutral.
Keeping the timings fixed and the acceptance state per request makes K a function of
the request's own outcomes, so a seed reproduces its sample within a process
(`track_costs=True` keeps refining the timings online instead, at that price).
Because T_verify is not monotone on every machine (fp32 on CPU: 3 tokens can cost
more than 4), a pass of n tokens may be padded to the cheaper size m > n; the
padding positions are ignored (`verify_size`).

In a batch the pass is shared: a row's K is chosen to maximise the decoding rows'
expected tokens per second, (E_others + E[N](alpha, K)) / (T_batch(tokens_others + K + 1)
+ D), with T_batch a shared round's cost as a function of the pass's total tokens and D
the round's drafting. A draft model's steps run in lockstep (its s-th step is one pass over
every row still drafting), so D = sum over s of T_d(rows drafting at step s), with T_d a
lockstep step's cost by its rows: a row's K is charged what its steps add to the batch's,
nearly nothing where the draft's curve is flat (a GPU), up to a whole step where it is steep.
Prompts' pieces in the same pass are left out (engine/round.py's `plan`). So K falls to 0 when the
batch already fills the machine, and rises where the curve is flat (a pass of 16 tokens
costing little more than one of 8).
T_batch is measured in the batch itself, on the rounds it runs (`observe_batch`: the
pass and every row's work on its logits; T_d likewise, `observe_draft_batch`), kept as a
level shared by every size times a shape per size (`BatchCosts`, so a size not run for a
while still follows the machine's drift), and taken from the calibrated curve at sizes not
yet run (T_d: the draft's calibrated step scaled by the target's calibrated curve). A
calibrated round is one sequence with one row's verification, which prices a batch's
rounds wrongly by more than the gains at stake (a pass of several one-token rows can cost
less than one sequence's pass of as many tokens, and drafts that lose then look ahead). Timings measured online make K depend on timing
noise, but only in shared rounds, where K already depends on the neighbours: the
law, never the sample, is what a batch promises.

K only decides how much work to speculate; it never changes the output law.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Protocol

from specdecode.core.theory import CostModel, expected_tokens
from specdecode.drafters.protocol import Situation
from specdecode.engine.calibration import interleaved_medians


@dataclass(frozen=True, slots=True)
class BatchLoad:
    """What the other rows of a shared pass put into it: tokens, tokens expected to be emitted, and
    the (drafter, K) of each row whose draft steps run in lockstep with the others' (a draft model's:
    its s-th step is one pass over every row still drafting, `drafters/model.py`'s `draft_together`)."""

    tokens: int
    expected: float
    lockstep: tuple[tuple[str, int], ...] = ()


ALONE = BatchLoad(0, 0.0)


class KPolicy(Protocol):
    def begin(self) -> None:
        """A new request starts."""

    def choose(self, drafter: str, lag: int = 0, load: BatchLoad = ALONE, situation: Hashable = None) -> int:
        """K for the next round if `drafter` proposes (0 = do not speculate with it); `lag` is how
        many tokens the drafter must catch up on before drafting (a draft model that sat out);
        `load`, what the batch's other rows put into the same pass; `situation`, the drafter's
        class of this round (prompt lookup's match length), whose acceptance is learned apart."""

    def expected_tokens(self, drafter: str, k: int, situation: Hashable = None) -> float:
        """Tokens a round of K drafts from `drafter` is expected to emit."""

    def verify_size(self, n: int) -> int:
        """How many tokens to run in a verification pass that needs n (>= n; extras are padding)."""

    def tree_alternatives(self, drafter: str, k: int, gains: list[float], load: BatchLoad = ALONE) -> int:
        """How many of a draft tree's alternatives to verify beside its chain of k (gains: each
        one's expected extra tokens, best first): each adds a token to the pass."""

    def observe(self, drafter: str, drafted: int, accepted: int, t_draft: float, n_verified: int,
                t_verify: float, situation: Hashable = None) -> None:
        """Learn from one round."""

    def observe_shadow(self, drafter: str, accept_probability: float, situation: Hashable = None) -> None:
        """Learn from a free drafter's first token that was not drafted: the target's p at that
        position gives the probability the rule would have accepted it (a one-hot q accepts x
        with probability p(x))."""

    def observe_batch(self, tokens: int, seconds: float, rows: int) -> None:
        """Learn what a shared round of `tokens` decoding tokens cost (its pass and its rows' work
        on the logits); each of the round's `rows` rows reports it."""

    def observe_draft_batch(self, drafter: str, rows: int, seconds: float, reporters: int) -> None:
        """Learn what one lockstep draft step of `rows` sequences cost in a shared round; each of
        the `reporters` rows that drafted in it reports it."""

    def wants_calibration(self) -> bool:
        """True until the target's cost curve has been measured."""

    def calibrate(self, time_pass: Callable[[int], float | None],
                  time_step: dict[str, Callable[[], float | None]],
                  time_catchup: dict[str, Callable[[], float | None]] | None = None) -> None:
        """Measure the target's pass time per size (None: does not fit), each drafter's step time
        and, for drafters that can fall behind, their catch-up time per token."""


@dataclass(frozen=True, slots=True)
class FixedK:
    """Always K drafts (the user pinned it with --k)."""

    k: int

    def begin(self) -> None:
        pass

    def choose(self, drafter: str, lag: int = 0, load: BatchLoad = ALONE, situation: Hashable = None) -> int:
        return self.k

    def expected_tokens(self, drafter: str, k: int, situation: Hashable = None) -> float:
        return float(k + 1)  # unknown acceptance: only a batch's other rows ask, and FixedK ignores it

    def verify_size(self, n: int) -> int:
        return n

    def tree_alternatives(self, drafter: str, k: int, gains: list[float], load: BatchLoad = ALONE) -> int:
        return len(gains)  # the user pinned the shape (--k, the drafter's tree size)

    def observe(self, drafter: str, drafted: int, accepted: int, t_draft: float, n_verified: int,
                t_verify: float, situation: Hashable = None) -> None:
        pass

    def observe_shadow(self, drafter: str, accept_probability: float, situation: Hashable = None) -> None:
        pass

    def observe_batch(self, tokens: int, seconds: float, rows: int) -> None:
        pass

    def observe_draft_batch(self, drafter: str, rows: int, seconds: float, reporters: int) -> None:
        pass

    def wants_calibration(self) -> bool:
        return False

    def calibrate(self, time_pass: Callable[[int], float | None],
                  time_step: dict[str, Callable[[], float | None]],
                  time_catchup: dict[str, Callable[[], float | None]] | None = None) -> None:
        pass


@dataclass
class BatchCosts:
    """A batch's costs as measured on its own rounds, by key (a shared round's decoding tokens, or
    a lockstep draft step's (drafter, rows)), kept as level x shape: a report's surprise (seconds
    over the key's estimate) moves the key's shape and the level shared by every key, half each.
    A slow spell slows every size alike (why calibration interleaves its sizes), so a size not run
    for a while follows the machine (by the square root of the others' change) instead of keeping
    its last run's value: a drafting size last seen in a fast spell would make drafts look cheap
    long after. The key's own estimate moves by surprise ** weight per report (a geometric EMA)."""

    level: float = 1.0
    shape: dict[Hashable, float] = field(default_factory=dict)

    def get(self, key: Hashable) -> float | None:
        return None if key not in self.shape else self.level * self.shape[key]

    def observe(self, key: Hashable, seconds: float, weight: float) -> None:
        """The first report of a key sets its cost; later ones move it by `weight` (in [0, 1])."""
        if key not in self.shape:
            self.shape[key] = seconds / self.level
            return
        step = (seconds / (self.level * self.shape[key])) ** (weight / 2)
        self.level *= step
        self.shape[key] *= step


@dataclass
class _DrafterState:
    accepted: float = 0.0
    tested: float = 0.0
    rounds_since_tried: int = 0
    shadowed: bool = False  # it reports what it would have drafted: never re-tested with real drafts


@dataclass
class AdaptiveK:
    """Per-round K from running estimates of alpha, draft cost and the verification-cost curve."""

    # The most drafts a round may verify. Where a backend's passes of 8 to 16 tokens cost about the
    # same (a tiled kernel), long copies pay for drafting 16; where that end of the curve is steep the
    # costs keep K short. Only the calibration measures the larger passes too.
    k_max: int = 16
    # Before evidence, assume a good draft, held lightly: drafting one token too many costs
    # t_draft (a fraction of a pass), one too few forgoes up to a whole token, and a draft of the
    # target's family is accepted well over half the time. Two rejections bring the estimate down
    # to 0.4 within the first rounds.
    prior_alpha: float = 0.8
    prior_weight: float = 2.0  # worth this many tested positions
    # ... but a situation's estimate starts neutral: the drafters that report situations (prompt
    # lookup) are free and heard through shadows, so a class can earn its drafts by evidence at no
    # cost, where optimism would pay a rejected pass for every new class
    situation_prior: float = 0.5
    # ... unless the drafter measured the class (`drafters.protocol.Situation.prior`): that prior is
    # held as firmly as this many tested positions (chosen by replaying recorded outputs:
    # benchmarks/lookup_bound.py).
    measured_prior_weight: float = 4.0
    forget: float = 0.98  # per-round decay of old acceptance evidence
    ema: float = 0.2  # weight of a new timing observation
    explore_every: int = 16  # try K=1 after this many rounds without drafting, to keep measuring
    # ... but only a drafter that would pay at this acceptance: where even a near-perfect draft
    # loses (a draft model against a steep pass curve), a test round
    # only costs (a pass of 2 tokens and the draft's catch-up on everything it skipped)
    explore_alpha: float = 0.95
    pad_gain: float = 0.9  # pad only when the bigger pass is at least 10% cheaper (beyond timing noise)
    sweeps: int = 3  # measured calibration sweeps (after one warm-up sweep)
    prior_c: float = 3.0  # assumed T_target / T_draft for a drafter whose step time is unknown
    # keep refining timings online (K then depends on timing noise; the online T is the pass's
    # alone, where the calibrated one includes the work on its logits: a few percent apart on a CPU)
    track_costs: bool = False
    # pass sizes beyond k_max + 1 to measure too: batches put many rows into one pass
    batch_sizes: tuple[int, ...] = ()
    t_verify: dict[int, float] = field(default_factory=dict)
    t_step: dict[str, float] = field(default_factory=dict)
    t_catchup: dict[str, float] = field(default_factory=dict)  # per token a drafter must catch up on
    # a shared round's cost by its tokens, measured in the batch (`observe_batch`); not stored in the
    # calibration file: it is this process's batch, and shared by every request's policy (`for_request`)
    t_batch: BatchCosts = field(default_factory=BatchCosts)
    # ... and a lockstep draft step's cost by (drafter, sequences in it), measured there too
    t_draft_batch: BatchCosts = field(default_factory=BatchCosts)
    # acceptance evidence by drafter, or by (drafter, situation) for a drafter that reports one
    drafters: dict[Hashable, _DrafterState] = field(default_factory=dict)
    # `_effective_curve` for the t_verify it was computed from: it is asked ~3 times a round and costs
    # O(k_max^2), so it is computed once per curve
    _curve: tuple[tuple | None, tuple[float, ...]] = field(default=(None, ()), init=False, repr=False,
                                                          compare=False)

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if self.sweeps < 1:
            raise ValueError(f"sweeps must be >= 1, got {self.sweeps}")

    # --- estimates -----------------------------------------------------------------------
    def alpha(self, drafter: str, situation: Hashable = None) -> float:
        s = self._state(drafter, situation)
        prior, weight = self.prior_alpha, self.prior_weight
        if situation is not None:
            prior, weight = (situation.prior, self.measured_prior_weight) if isinstance(situation, Situation) \
                else (self.situation_prior, weight)
        return (s.accepted + prior * weight) / (s.tested + weight)

    def cost_model(self, drafter: str, lag: int = 0) -> CostModel:
        curve = self._effective_curve()
        return CostModel.measured(t_draft=self.t_step.get(drafter, curve[0] / self.prior_c), t_verify=curve,
                                  t_setup=lag * self.t_catchup.get(drafter, 0.0))

    def _effective_curve(self) -> tuple[float, ...]:
        """T(n) for n = 1..k_max+1, each at the (possibly padded) size `verify_size` picks."""
        key = (self.k_max, self.pad_gain, tuple(self.t_verify.items()))
        if self._curve[0] != key:
            self._curve = (key, tuple(self._t(self.verify_size(n)) for n in range(1, self.k_max + 2)))
        return self._curve[1]

    def _t(self, n: int) -> float:
        """T_verify(n): measured, else interpolated linearly between measured sizes (extrapolated
        from the two largest beyond them); flat (the documents' model) until measured."""
        if n in self.t_verify or not self.t_verify:
            return self.t_verify.get(n, 1.0)
        sizes = sorted(self.t_verify)
        lo = max([m for m in sizes if m < n], default=None)
        hi = min([m for m in sizes if m > n], default=None)
        if lo is None:
            return self.t_verify[hi]
        if hi is None:
            if len(sizes) == 1:
                return self.t_verify[lo]
            lo, hi = sizes[-2], sizes[-1]
        slope = (self.t_verify[hi] - self.t_verify[lo]) / (hi - lo)
        return self.t_verify[lo] + slope * (n - lo)

    def _t_shared(self, n: int) -> float:
        """T_batch(n): a shared round of n tokens as measured in the batch, else as calibrated."""
        return self.t_batch.get(n) or self._t(n)

    def _t_draft_step(self, drafter: str, rows: int) -> float:
        """T_d(rows): one lockstep draft step of `rows` sequences as measured in the batch, else the
        drafter's calibrated one-sequence step scaled by the target's calibrated curve, T(rows) / T(1)
        (the draft is a smaller model on the same kernels: its step grows with rows about as the
        target's pass grows with tokens)."""
        if rows < 1:
            return 0.0
        t_step = self.t_step.get(drafter, self._t(1) / self.prior_c)
        return self.t_draft_batch.get((drafter, rows)) or t_step * self._t(rows) / self._t(1)

    def _shared_draft_seconds(self, lockstep: tuple[tuple[str, int], ...]) -> float:
        """The lockstep draft loop of these rows: for each drafter, sum over steps s of
        T_d(rows still drafting at step s), so a row's K costs what its steps add to the batch's."""
        total = 0.0
        for name in {name for name, _ in lockstep}:
            ks = [k for n, k in lockstep if n == name]
            total += sum(self._t_draft_step(name, sum(k >= s for k in ks)) for s in range(1, max(ks) + 1))
        return total

    def for_request(self) -> "AdaptiveK":
        """A policy for one more concurrent request: the same measured costs, the batch's included
        (shared, not copied), its own acceptance evidence."""
        return replace(self, drafters={})

    # --- KPolicy -------------------------------------------------------------------------
    def begin(self) -> None:
        self.drafters.clear()  # acceptance evidence is per request; timings are kept

    def choose(self, drafter: str, lag: int = 0, load: BatchLoad = ALONE, situation: Hashable = None) -> int:
        """The K that maximises expected tokens per second this round, counting the catch-up a
        lagging draft model must do first (a long catch-up can cost several target steps: a test round
        after every pause would cost more than it could win)."""
        s = self._state(drafter, situation)
        best = lambda alpha: self._best_k(drafter, alpha, lag, load)  # noqa: E731
        k = best(self.alpha(drafter, situation))
        if k == 0 and not s.shadowed and s.rounds_since_tried >= self.explore_every and best(self.explore_alpha):
            return 1  # re-test now and then: the text may have become easier to draft
        return k

    def _best_k(self, drafter: str, alpha: float, lag: int, load: BatchLoad) -> int:
        if load == ALONE:
            return self.cost_model(drafter, lag).optimal_k(alpha, self.k_max)
        t_setup = lag * self.t_catchup.get(drafter, 0.0)
        others = self._shared_draft_seconds(load.lockstep)

        def rate(k: int) -> float:
            """The whole round's expected tokens per second: the pass, and the draft loop of every
            row drafting in lockstep, this row's K included (a drafter outside the lockstep, prompt
            lookup, pays its own steps: T_d(1) each, as no other row shares them)."""
            if k == 0:
                return (load.expected + 1) / (self._t_shared(load.tokens + 1) + others)
            drafting = t_setup + self._shared_draft_seconds(load.lockstep + ((drafter, k),))
            return (load.expected + expected_tokens(alpha, k)) / (self._t_shared(load.tokens + k + 1) + drafting)
        return max(range(self.k_max + 1), key=lambda k: (rate(k), -k))

    def expected_tokens(self, drafter: str, k: int, situation: Hashable = None) -> float:
        return expected_tokens(self.alpha(drafter, situation), k)

    def tree_alternatives(self, drafter: str, k: int, gains: list[float], load: BatchLoad = ALONE) -> int:
        """The number m of alternatives (best first) that maximises the pass's expected tokens per
        second, as K is chosen: (E_others + E[N](alpha, k) + gains[:m]) / (T(tokens + k + 1 + m) + draft)."""
        if load == ALONE:
            t, t_draft = self._t, k * self.t_step.get(drafter, self._t(1) / self.prior_c)
        else:
            t, t_draft = self._t_shared, self._shared_draft_seconds(load.lockstep + ((drafter, k),))
        expected = load.expected + expected_tokens(self.alpha(drafter), k)

        def rate(m: int) -> float:
            return (expected + sum(gains[:m])) / (t(load.tokens + k + 1 + m) + t_draft)
        return max(range(len(gains) + 1), key=lambda m: (rate(m), -m))

    def verify_size(self, n: int) -> int:
        best = n
        for m in range(n + 1, self.k_max + 2):
            if m in self.t_verify and best in self.t_verify and self._t(m) < self.pad_gain * self._t(best):
                best = m
        return best

    def observe(self, drafter: str, drafted: int, accepted: int, t_draft: float, n_verified: int,
                t_verify: float, situation: Hashable = None) -> None:
        for key, s in self.drafters.items():
            s.rounds_since_tried = 0 if key in (drafter, (drafter, situation)) else s.rounds_since_tried + 1
        if self.track_costs:
            self._track(self.t_verify, n_verified, t_verify)
        if drafted == 0:
            return
        s = self._state(drafter, situation)
        s.accepted = self.forget * s.accepted + accepted
        s.tested = self.forget * s.tested + min(accepted + 1, drafted)
        if self.track_costs:
            self._track(self.t_step, drafter, t_draft / drafted)

    def observe_shadow(self, drafter: str, accept_probability: float, situation: Hashable = None) -> None:
        """Evidence at no cost, in place of re-testing: one tested position, accepted with this
        probability (its expectation; the estimate is a mean). A drafter that reports shadows is
        never re-tested at the price of a pass (`explore_every` is for drafters whose guesses
        cost something to see: the draft model)."""
        s = self._state(drafter, situation)
        s.accepted = self.forget * s.accepted + accept_probability
        s.tested = self.forget * s.tested + 1
        s.shadowed = True

    def observe_batch(self, tokens: int, seconds: float, rows: int) -> None:
        """Each row's report weighs 1/rows of one observation (`ema`), so a round counts once."""
        self.t_batch.observe(tokens, seconds, self.ema / max(1, rows))

    def observe_draft_batch(self, drafter: str, rows: int, seconds: float, reporters: int) -> None:
        """As `observe_batch`: each drafting row's report weighs 1/reporters of one observation."""
        self.t_draft_batch.observe((drafter, rows), seconds, self.ema / max(1, reporters))

    def wants_calibration(self) -> bool:
        """No costs yet, or none for a pass size this policy may choose (1..k_max+1, and a batch's sizes):
        a calibration file written by a policy with a smaller k_max lacks the larger sizes."""
        return not self.t_verify or any(n not in self.t_verify
                                        for n in (*range(1, self.k_max + 2), *self.batch_sizes))

    def calibrate(self, time_pass: Callable[[int], float | None],
                  time_step: dict[str, Callable[[], float | None]],
                  time_catchup: dict[str, Callable[[], float | None]] | None = None) -> None:
        """One warm-up sweep (a shape's first pass is slow), then `sweeps` measured sweeps, each
        timing every pass size and every drafter's step; a cost is the median over sweeps.

        Interleaving matters on a noisy machine: a slow spell slows every size (and the drafters)
        alike, so the curve's shape and the draft/target ratio, which are all K depends on,
        survive noise that moves their level (engine/calibration.py's `interleaved_medians`).
        """
        medians = interleaved_medians(
            {**{("pass", n): (lambda n=n: time_pass(n)) for n in sorted({*range(1, self.k_max + 2), *self.batch_sizes})},
             **{("step", name): measure for name, measure in time_step.items()},
             **{("catchup", name): measure for name, measure in (time_catchup or {}).items()}}, self.sweeps)
        self.t_verify = {n: t for (kind, n), t in medians.items() if kind == "pass"}
        self.t_step = {name: t for (kind, name), t in medians.items() if kind == "step"}
        self.t_catchup = {name: t for (kind, name), t in medians.items() if kind == "catchup"}

    def costs(self) -> dict:
        """The measured costs, as JSON-able data (see engine/calibration.py)."""
        return {"t_verify": {str(n): t for n, t in self.t_verify.items()}, "t_step": dict(self.t_step),
                "t_catchup": dict(self.t_catchup)}

    def load_costs(self, costs: dict) -> None:
        """Take costs measured earlier (`costs()`) instead of calibrating."""
        self.t_verify = {int(n): float(t) for n, t in costs["t_verify"].items()}
        self.t_step = {str(name): float(t) for name, t in costs["t_step"].items()}
        self.t_catchup = {str(name): float(t) for name, t in costs.get("t_catchup", {}).items()}

    def _track(self, table: dict, key, t: float) -> None:
        table[key] = t if key not in table else (1 - self.ema) * table[key] + self.ema * t

    def _state(self, drafter: str, situation: Hashable = None) -> _DrafterState:
        return self.drafters.setdefault(drafter if situation is None else (drafter, situation), _DrafterState())


def batch_pass_sizes(max_batch: int, k_max: int) -> tuple[int, ...]:
    """Pass sizes beyond k_max + 1 whose cost a batch's K policy needs (the curve between them is
    interpolated): every size up to 16 (where CPU kernels change tiling), then sparser."""
    top = max_batch * (k_max + 1)
    return tuple(n for n in (*range(k_max + 2, 17), 20, 24, 32, 48, 64, 96, 128) if n <= max(top, k_max + 2))
