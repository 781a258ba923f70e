"""Adaptive K's measured costs, kept per machine, model, backend and drafter in the cache directory.

Calibrating (timing target passes of 1..k_max+1 tokens and each drafter's step) takes seconds
on the llama.cpp backend and minutes on a slow one; doing it once per machine
keeps it out of every process's first request, and makes K, and so a seeded sample,
the same in every process that reads the same file. `recalibrate=True` measures anew
(and rewrites the file); delete the directory to forget every entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from specdecode.drafters.protocol import Drafter

# The context a calibration measures after where no request gives one (a server's start, the bench): any
# text will do, as the costs depend on the pass sizes and the context's length, not on the tokens.
CALIBRATION_TEXT = "def f(x):\n    return x * 2\n" * 4


def machine_id() -> str:
    """The CPU model and core count: what the timings depend on besides the model."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 0
    return f"{cpu} x{cores}"


# what the stored costs measure; a file written under another version is measured anew
# (2: a round's cost includes the work on the pass's logits, engine/loop.py's `time_pass`;
# 3: a greedy round's verification draws no V-sized noise, 3.6 ms less on Qwen's vocabulary;
# 4: no round draws V-sized noise: the last sample is an inverse CDF at one uniform;
# 5: a plain greedy step builds no one-hot p, 0.2 ms less a step beside llama.cpp)
COSTS_VERSION = 5


def calibration_key(target, drafters: Sequence[Drafter]) -> str:
    return " | ".join([f"costs v{COSTS_VERSION}", machine_id(), target.signature, *(d.signature for d in drafters)])


class CalibrationStore:
    """JSON files under `directory`, one per calibration key (the key is stored inside, too)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def path(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"

    def load(self, key: str) -> dict | None:
        """The costs stored under `key`, or None: absent, another key's (a hash collision), or unusable
        (not JSON, or not the shape `costs()` writes, e.g. edited by hand), which `ensure` then measures
        anew and overwrites; an unusable file is named on stderr, so a hand edit is not lost silently."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except OSError as exc:
            return _ignored(path, f"unreadable: {exc.strerror or exc}")
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            return _ignored(path, f"not JSON: {exc}")
        if not isinstance(data, dict):
            return _ignored(path, "not a JSON object")
        if data.get("key") != key:
            return None
        problem = costs_problem(data.get("costs"))
        return data["costs"] if problem is None else _ignored(path, problem)

    def save(self, key: str, costs: dict) -> None:
        """Write atomically; a cache that cannot be written only costs a recalibration next time."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".calibration-")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "costs": costs}, f, indent=1)
            os.replace(tmp, self.path(key))
        except OSError:
            pass

    def ensure(self, policy, key: str, measure: Callable[[], None], recalibrate: bool = False) -> bool:
        """Give `policy` its costs from the file, or `measure` them and save. True if loaded."""
        costs = None if recalibrate else self.load(key)
        if costs is not None:
            policy.load_costs(costs)
            if not policy.wants_calibration():  # e.g. a batch needs pass sizes the file lacks
                return True
        measure()
        self.save(key, policy.costs())
        return False


def costs_problem(costs) -> str | None:
    """What makes `costs` unlike what `AdaptiveK.costs()` writes, in words; None if nothing does.
    Checked before `AdaptiveK.load_costs`, which fails on a missing table or a key that is not a number,
    and would take a negative time into a cost model that refuses it mid-request."""
    if not isinstance(costs, dict):
        return "'costs' is not a JSON object"
    missing = [table for table in ("t_verify", "t_step") if table not in costs]  # t_catchup came later
    if missing:
        return f"no {missing[0]!r}"
    return next(filter(None, (_table_problem(table, costs.get(table, {}))
                              for table in ("t_verify", "t_step", "t_catchup"))), None)


def _table_problem(table: str, times) -> str | None:
    if not isinstance(times, dict):
        return f"{table!r} is not a JSON object"
    positive = table == "t_verify"  # a pass takes time; a free drafter's step may time as 0
    for name, t in times.items():
        if table == "t_verify" and not (name.isdecimal() and int(name) >= 1):
            return f"{table!r} has the key {name!r}, not a pass size (1, 2, ...)"
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 \
                or (positive and t == 0):
            return f"{table}[{name!r}] is {t!r}, not a {'positive' if positive else 'non-negative'} time"
    return None


def _ignored(path: Path, problem: str) -> None:
    """One line on stderr naming the file and what is wrong with it; None, as `load` returns."""
    sys.stderr.write(f"specdecode: ignoring the calibration file {str(path)!r} ({problem}); measuring anew\n")
    return None
