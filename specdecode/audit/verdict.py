"""The audits' verdicts and the exit status each gives the shell, in-process and black-box alike."""

from __future__ import annotations

from typing import Sequence

# An audit that could not see its own negative control has not shown exactness: that is not a pass.
EXIT = {"pass": 0, "fail": 1, "inconclusive": 3}
NOT_RUN = 2  # the audit could not run as asked (bad options, an endpoint that cannot be audited)


def verdict(failed: bool, doubts: Sequence[str] = ()) -> str:
    """"fail" if a check failed; else "inconclusive" if anything kept the audit from concluding (the
    doubts: a control unseen, a check without a test); else "pass"."""
    return "fail" if failed else "inconclusive" if doubts else "pass"


def not_rejected(p_value: float | None, level: float) -> bool:
    """A test passes unless its p-value falls below its level; an untested one (None) fails nothing
    (its report calls it inconclusive instead)."""
    return p_value is None or p_value >= level


class LevelTest:
    """Mixed into the record of one test (it has `p_value`, None when the test could not run, and
    `level`): whether it ran, and whether it passed."""

    __slots__ = ()
    p_value: float | None
    level: float

    @property
    def tested(self) -> bool:
        return self.p_value is not None

    @property
    def passed(self) -> bool:
        return not_rejected(self.p_value, self.level)
