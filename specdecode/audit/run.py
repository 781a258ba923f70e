"""`specdecode audit`: a statistical certificate that speculative decoding is lossless here.

For the user's target, drafters, K policy and sampling settings, on a few prompts:
- next-token law: many independent rounds from the same prefix; the first emitted
  token against the target's exact p (chi-square, TV with a confidence bound);
- two-token law: the first two emitted tokens against p(y1) p(y2 | y1);
- greedy identity: speculative greedy == plain greedy over a longer generation (in
  bf16/fp16, and on a backend whose kernels round by pass shape (llama.cpp: its
  `logit_tolerance`, 0.25), a divergence at a numerical near-tie of the target's logits
  is reported as numerics, not failure; in fp32/fp64 any divergence fails);
- a negative control: the next-token test again with a deliberately broken rule,
  which must be flagged, so the audit demonstrably has power.

False failures: the overall probability that a correct engine fails any statistical
check is at most `level` (Bonferroni: each of the m tests runs at level / m).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
from tqdm.auto import tqdm

from specdecode.audit.checks import LawCheck, law_check
from specdecode.audit.controls import CONTROLS
from specdecode.audit.laws import next_logits, next_token_law, sample_first_tokens, two_token_law
from specdecode.audit.verdict import verdict
from specdecode.backends.protocol import Model
from specdecode.core.probs import GREEDY, SamplingParams
from specdecode.core.verify import verify
from specdecode.drafters.protocol import Drafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.engine import generate_tokens
from specdecode.engine.policy import AdaptiveK, FixedK, KPolicy
from specdecode.engine.request import VerifyRule
from specdecode.engine.slot import Slot


@dataclass(frozen=True, slots=True)
class AuditConfig:
    samples: int = 400  # rounds per law check
    greedy_tokens: int = 64
    level: float = 1e-3  # overall false-failure probability of the statistical checks
    k: int | None = None  # None = adaptive K
    control: str = "always-accept"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 20:
            raise ValueError(f"samples must be >= 20 for the chi-square approximation, got {self.samples}")
        if not 0 < self.level < 1:
            raise ValueError(f"level must be in (0, 1), got {self.level}")
        if self.control not in CONTROLS:
            raise ValueError(f"control must be one of {', '.join(CONTROLS)}, got {self.control!r}")
        if self.greedy_tokens < 1:
            raise ValueError("greedy_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class GreedyCheck:
    name: str
    tokens: int
    passed: bool
    diverged_at: int | None
    note: str
    seconds: float


@dataclass
class AuditReport:
    sampling: SamplingParams
    config: AuditConfig
    law_checks: list[LawCheck] = field(default_factory=list)
    greedy_checks: list[GreedyCheck] = field(default_factory=list)
    control: LawCheck | None = None
    control_support: int | None = None  # tokens of positive probability in the control's exact law
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        """A check failed (an untested one fails nothing)."""
        return not (all(c.passed for c in self.law_checks) and all(c.passed for c in self.greedy_checks))

    @property
    def control_detected(self) -> bool | None:
        return None if self.control is None else not self.control.passed

    @property
    def verdict(self) -> str:
        """"fail" if a check failed; "inconclusive" if none did but a law check had too few samples for a
        test, or the broken control rule went unseen too (see `advice` for why); "pass" otherwise."""
        doubts = [c.name for c in self.law_checks if not c.tested]
        doubts += [self.control.name] if self.control_detected is False else []
        return verdict(self.failed, doubts)

    @property
    def advice(self) -> str | None:
        """Why the audit could not conclude (a law check untested, or the negative control unseen) and what
        would let it; None if it could."""
        untested = [c.name for c in self.law_checks if not c.tested]
        if self.verdict != "inconclusive":
            return None
        if self.control_support == 1:
            # a one-token law is what every rule emits (and top-k 1 makes the drafts deterministic
            # too): any number of samples looks the same, so --samples cannot help
            return ("the sampling settings leave a single token to sample, so the audit cannot tell a broken "
                    "rule from the right one: raise --top-k, --top-p or --temperature")
        if untested:
            return (f"too few samples for a chi-square test in {', '.join(untested)} (a test needs two cells "
                    f"expecting 5 samples or more): raise --samples")
        return "too few samples to see a defect of the control's size: raise --samples for more power"

    def to_dict(self) -> dict:
        law = [{**asdict(c), "passed": c.passed, "tested": c.tested} for c in self.law_checks]
        # "passed" as a script reads it: the verdict pass (it was "no check failed", true when inconclusive)
        return {"verdict": self.verdict, "passed": self.verdict == "pass", "failed": self.failed,
                "sampling": asdict(self.sampling),
                "config": asdict(self.config),
                "law_checks": law, "greedy_checks": [asdict(c) for c in self.greedy_checks],
                "control": None if self.control is None else {**asdict(self.control), "tested": self.control.tested,
                                                              "detected": self.control_detected},
                "advice": self.advice,
                "seconds": self.seconds}


BATCHED_K = 3  # drafts per round of the audited sequence in a batched audit without --k


def run_audit(target: Model, drafters: Sequence[Drafter], prompts: Sequence[Sequence[int]],
              sampling: SamplingParams, config: AuditConfig = AuditConfig(), rule: VerifyRule = verify,
              progress: bool = True, neighbours: Sequence[tuple[Slot, Sequence[int]]] = ()) -> AuditReport:
    """Audit `rule` (the real one by default) with these drafters on these prompts; with
    `neighbours` (slot, prefix), the law checks run batched beside those sequences."""
    if not drafters:
        raise ValueError("the audit needs at least one drafter: it checks speculative decoding")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("give at least one non-empty prompt")
    if sampling.greedy:
        raise ValueError("the law checks need sampling (temperature > 0); greedy is covered by greedy identity")
    t_start = time.perf_counter()
    report = AuditReport(sampling, config)
    tests = 2 * len(prompts)
    level = config.level / tests  # Bonferroni over the statistical tests
    generator = torch.Generator().manual_seed(config.seed)
    # Batched, an uncalibrated adaptive K sees the neighbours' rows fill the pass and drafts nothing,
    # which would leave the rule untested: there the audit drafts a fixed K unless one is given.
    k = config.k if config.k is not None else (BATCHED_K if neighbours else None)
    policy: KPolicy = AdaptiveK() if k is None else FixedK(k)
    total = config.samples * (tests + 1) + 2 * len(prompts)
    bar = tqdm(total=total, desc="audit", disable=not progress, unit="round")
    tick = bar.update

    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        p = next_token_law(target, prompt, sampling)
        draws = sample_first_tokens(target, drafters, policy, prompt, sampling, config.samples, 1, generator,
                                    rule, tick, neighbours)
        cells = {(t,): float(p[t]) for t in range(p.shape[0]) if p[t] > 0}
        report.law_checks.append(law_check(f"prompt {i + 1}: next-token law", draws, cells, 0.0, level,
                                           time.perf_counter() - t0))
        t0 = time.perf_counter()
        cells2, rest = two_token_law(target, prompt, sampling)
        draws = sample_first_tokens(target, drafters, policy, prompt, sampling, config.samples, 2, generator,
                                    rule, tick, neighbours)
        report.law_checks.append(law_check(f"prompt {i + 1}: two-token law", draws, cells2, rest, level,
                                           time.perf_counter() - t0))

    t0 = time.perf_counter()
    p = next_token_law(target, prompts[0], sampling)
    draws = sample_first_tokens(target, drafters, policy, prompts[0], sampling, config.samples, 1, generator,
                                CONTROLS[config.control], tick, neighbours)
    cells = {(t,): float(p[t]) for t in range(p.shape[0]) if p[t] > 0}
    report.control_support = len(cells)
    report.control = law_check(f"negative control ({config.control}, prompt 1)", draws, cells, 0.0, level,
                               time.perf_counter() - t0)

    for i, prompt in enumerate(prompts):
        report.greedy_checks.append(greedy_identity(target, drafters, prompt, config, f"prompt {i + 1}",
                                                    rule, tick))
    bar.close()
    report.seconds = time.perf_counter() - t_start
    return report


def greedy_identity(target: Model, drafters: Sequence[Drafter], prompt: Sequence[int], config: AuditConfig,
                    name: str, rule: VerifyRule = verify, tick=None) -> GreedyCheck:
    t0 = time.perf_counter()
    gen = GenerationConfig(max_new_tokens=config.greedy_tokens, sampling=GREEDY, k=config.k)
    plain = [t for r in generate_tokens(target, [], prompt, gen, frozenset()) for t in r.tokens]
    if tick:
        tick()
    policy = AdaptiveK() if config.k is None else FixedK(config.k)
    spec = [t for r in generate_tokens(target, drafters, prompt, gen, frozenset(), policy=policy, rule=rule)
            for t in r.tokens]
    if tick:
        tick()
    seconds = time.perf_counter() - t0
    if spec == plain:
        return GreedyCheck(f"{name}: greedy identity", len(plain), True, None, "token-identical", seconds)
    at = next((i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
    tie, gap = _numerical_tie(target, list(prompt) + plain[:at], plain, spec, at)
    note = (f"diverged at token {at} where the target's two candidates differ by {gap:.4g} in logit: a "
            f"numerical near-tie in {_dtype(target)}" if tie else
            f"diverged at token {at} (logit gap {gap:.4g}): NOT explained by numerics")
    return GreedyCheck(f"{name}: greedy identity", len(plain), tie, at, note, seconds)


def _numerical_tie(target: Model, context: list[int], plain: list[int], spec: list[int],
                   at: int) -> tuple[bool, float]:
    """Is the divergence a near-tie of the target's logits (bf16/fp16 rounding), or a real difference?"""
    if at >= len(plain) or at >= len(spec):
        return False, float("inf")
    logits = next_logits(target, context).float()
    gap = abs(float(logits[plain[at]] - logits[spec[at]]))
    tolerance = target.logit_tolerance  # a backend whose kernels round by pass shape (backends/protocol.py)
    if tolerance is not None:
        return gap <= tolerance, gap
    dtype = _dtype(target)
    if dtype in (torch.float32, torch.float64):
        return False, gap
    tolerance = 8 * torch.finfo(dtype).eps * max(1.0, float(logits.abs().max()))
    return gap <= tolerance, gap


def _dtype(target: Model) -> torch.dtype:
    return getattr(target, "dtype", torch.float32)
