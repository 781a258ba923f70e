"""Timing: adaptive K's measured costs, how they are measured, and where they are kept.

A round's cost is measured as the round pays it (`time_pass`: the target's pass over n tokens and
the work on its logits, as the verify stage does it), a drafter's as its marginal time per drafted
token (`time_step`) and, for a lockstep drafter, per token it catches up on (`time_catchup`). Every
measure runs in interleaved sweeps (`interleaved_medians`): a slow spell of a noisy machine slows
every size alike, so the curve's shape and the draft/target ratio, which are all K depends on,
survive it.

Calibrating takes seconds on the llama.cpp backend and minutes on a slow one; the costs are kept per
machine, model, backend and drafter in the cache directory (`CalibrationStore`), which keeps it out
of every process's first request, and makes K, and so a seeded sample, the same in every process
that reads the same file. `recalibrate=True` measures anew (and rewrites the file); delete the
directory to forget every entry.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Hashable, Sequence

import torch

from specdecode.backends.protocol import Model
from specdecode.core.probs import SamplingParams, logits_to_probs
from specdecode.core.verify import Randomness, verify
from specdecode.drafters.protocol import Drafter
from specdecode.engine.slot import Slot, prefill
from specdecode.engine.verification import plain_token, verify_chains

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


# what the stored costs measure (a round as `time_pass` times it: its pass and the work on its logits);
# a file written under another version is measured anew. Raise it when that work changes.
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


def calibrate(policy, slot: Slot, prompt: Sequence[int], params: SamplingParams) -> None:
    """Measure `policy`'s costs in `slot` after `prompt`: a round of each size (the target's pass and
    the work on its logits, with `params`), each drafter's step and a lockstep drafter's catch-up
    (the slot's caches reset after; the target holds prompt[:-1])."""
    prompt = list(prompt)
    target, drafters = slot.target, slot.drafters
    prefill(target, drafters, prompt)
    policy.calibrate(lambda n: time_pass(target, prompt[-1], n, params),
                     {d.name: (lambda d=d: time_step(d, prompt, params)) for d in drafters},
                     {d.name: (lambda d=d: time_catchup(d, prompt, params)) for d in drafters if d.lockstep})


def interleaved_medians(measures: dict[Hashable, Callable[[], float | None]], sweeps: int) -> dict[Hashable, float]:
    """One warm-up sweep (a shape's first pass is slow), then `sweeps` sweeps that each call every
    measure in turn; the median per key (a measure returns None when it cannot run, e.g. a pass that
    does not fit; a key with no time at all is left out)."""
    samples: dict[Hashable, list[float]] = {key: [] for key in measures}
    for sweep in range(1 + sweeps):
        for key, measure in measures.items():
            t = measure()
            if sweep > 0 and t is not None:
                samples[key].append(t)
    return {key: statistics.median(ts) for key, ts in samples.items() if ts}


def time_pass(target: Model, token: int, n: int, params: SamplingParams | None = None) -> float | None:
    """Wall time of one target pass over n tokens, leaving the cache as it was (None: no room).

    params: also time what a round does with the pass's logits (engine/verification.py): a plain
    step's token (n = 1), or the probabilities of every row and the verification of n - 1 one-hot
    drafts (the residual, its float64 cumulative sum and the accept tests), which on a CPU is part of
    a round that drafts and so of what adaptive K must weigh. The calibrating request's sampling
    prices every later request's rounds (as it prices the drafters' steps)."""
    length = target.length
    if length + n > target.max_length:
        return None
    t0 = time.perf_counter()
    logits = target.forward([token] * n, n_logits=n)
    if params is not None:
        generator = torch.Generator().manual_seed(0)  # its own: no effect on any output
        if n > 1:
            p = logits_to_probs(logits, params)
            verify_chains(verify, [[token] * (n - 1)], [None], [p], [Randomness.draw(1, n - 1, generator, p.device)])
        else:
            plain_token(logits[0], params, generator, length)
    elapsed = time.perf_counter() - t0
    target.truncate(length)
    return elapsed


def time_step(drafter: Drafter, prompt: list[int], params: SamplingParams) -> float | None:
    """A drafter's marginal time per drafted token, measured on the prompt (state reset after)."""
    t0 = time.perf_counter()
    proposal = drafter.propose(prompt, 3, params, torch.Generator().manual_seed(0))  # own RNG: no effect on output
    elapsed = time.perf_counter() - t0
    drafter.reset()
    if proposal.tokens and proposal.step_seconds is not None:
        return proposal.step_seconds
    return elapsed / max(1, len(proposal.tokens))  # e.g. lookup: the cost of looking


def time_catchup(drafter: Drafter, prompt: list[int], params: SamplingParams, n: int = 16) -> float | None:
    """A lockstep drafter's time per token to catch up on `n` tokens it has not seen (state reset after)."""
    context = list(prompt) + [prompt[-1]] * n  # the ids do not change the cost
    generator = torch.Generator().manual_seed(0)  # own RNG: no effect on output
    drafter.propose(context[:-n], 1, params, generator)  # in sync up to n tokens before the end
    t0 = time.perf_counter()
    proposal = drafter.propose(context, 1, params, generator)  # catch up on n - 1, then one draft step
    elapsed = time.perf_counter() - t0
    drafter.reset()
    if not proposal.tokens:
        return None  # e.g. the draft's context is too short for the measurement
    return max(0.0, elapsed - (proposal.step_seconds or 0.0)) / (n - 1)


def measure_cost_curve(target: Model, ids: list[int], max_n: int, reps: int = 3) -> list[float]:
    """Median wall time of a bare target pass over n = 1..max_n tokens after `ids` (the benchmark's
    report of the curve), in interleaved sweeps as the calibration times it."""
    prefill(target, [], ids)
    medians = interleaved_medians({n: (lambda n=n: time_pass(target, ids[-1], n)) for n in range(1, max_n + 1)},
                                  reps)
    return [medians[n] for n in range(1, max_n + 1)]
