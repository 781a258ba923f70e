"""What a black-box audit found: its tests, greedy checks, negative control, and the verdict."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specdecode.audit.remote.compare import Comparison, GreedyCheck
from specdecode.audit.verdict import verdict


@dataclass
class RemoteReport:
    endpoint: dict  # url, model, body of each side
    reference: dict
    level: float  # overall false-failure probability (Bonferroni: each test at level / tests)
    power: float  # of the detectable-TV figures
    samples: int  # answers per side per group
    tests: int  # the number of statistical tests planned
    comparisons: list[Comparison] = field(default_factory=list)
    greedy: list[GreedyCheck] = field(default_factory=list)
    controls: list[Comparison] = field(default_factory=list)  # the reference against itself, at a perturbed temperature
    notes: list[str] = field(default_factory=list)  # fields or request kinds a server refused, and so skipped
    planned: int = 0  # requests
    sent: int = 0  # answered
    retried: int = 0
    drafts: dict = field(default_factory=dict)  # side -> {"drafted", "accepted"} (our server's usage extension)
    interrupted: bool = False
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return any(not c.passed for c in self.comparisons) or any(g.result == "loss" for g in self.greedy)

    @property
    def control_detected(self) -> bool | None:
        """Did a test of the negative control reject, on any of its groups (None: the control did not run)?"""
        return any(not c.passed for c in self.controls) if self.controls else None

    @property
    def detectable_tv(self) -> float | None:
        """The largest of the tests' detectable TVs: every test had `power` against a difference this size."""
        values = [c.detectable_tv for c in self.comparisons if c.detectable_tv is not None and c.test != "logprobs"]
        return max(values) if values else None

    @property
    def verdict(self) -> str:
        """"fail" if a test rejected or a greedy answer diverged beyond a near-tie; "inconclusive" if none
        did but the control went unseen, a greedy divergence could not be explained or the run was
        interrupted (see `advice`); "pass" otherwise."""
        return verdict(self.failed, self._doubts())

    def _doubts(self) -> list[str]:
        doubts = []
        if self.interrupted:
            doubts.append(f"the run was interrupted after {self.sent} of {self.planned} requests: rerun it whole")
        if self.control_detected is None:
            doubts.append("the negative control did not run")
        elif not self.control_detected:
            size = max((c.tv for c in self.controls if c.tv is not None), default=0.0)
            doubts.append(f"the negative control went unseen (TV up to {size:.3f} between its samples): too few samples "
                          f"to see a distortion of its size, raise --samples")
        endpoint, reference = self.drafts.get("endpoint"), self.drafts.get("reference")
        if endpoint is not None and endpoint["drafted"] == 0:
            doubts.append("the endpoint reports no drafts in its answers, so nothing speculative was audited: pin "
                          "its drafts per round (our server: --body '{\"specdecode\": {\"k\": 2}}')")
        if reference is not None and reference["drafted"] > 0:
            doubts.append(f"the reference reports {reference['drafted']} drafts: it speculated too, so it is no "
                          f"reference (turn its speculation off with --reference-body)")
        unexplained = [g for g in self.greedy if g.result == "unexplained"]
        if unexplained:
            doubts.append(f"greedy answers diverged ({'; '.join(f'{g.name}: {g.note}' for g in unexplained)}): "
                          f"with logprobs (top_logprobs >= 2) the audit tells a near-tie from a loss")
        return doubts

    @property
    def advice(self) -> str | None:
        """Why the audit could not conclude and what would let it; None if it could."""
        doubts = self._doubts()
        return "; ".join(doubts) if doubts and not self.failed else None

    def to_dict(self) -> dict:
        def comparison(c: Comparison) -> dict:
            return {"name": c.name, **asdict(c), "samples": list(c.samples), "passed": c.passed, "tested": c.tested}

        return {"verdict": self.verdict, "passed": self.verdict == "pass", "failed": self.failed,
                "endpoint": self.endpoint, "reference": self.reference, "level": self.level,
                "tests": self.tests, "samples": self.samples, "power": self.power,
                "detectable_tv": self.detectable_tv,
                "comparisons": [comparison(c) for c in self.comparisons],
                "greedy": [{**asdict(g), "passed": g.passed} for g in self.greedy],
                "controls": [comparison(c) for c in self.controls], "control_detected": self.control_detected,
                "notes": self.notes, "requests": {"planned": self.planned, "answered": self.sent,
                                                  "retried": self.retried},
                "drafts": self.drafts, "interrupted": self.interrupted, "advice": self.advice,
                "seconds": self.seconds}
