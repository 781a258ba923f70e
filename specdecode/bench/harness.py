"""Side-by-side benchmark: every method on every prompt, interleaved in one process.

Interleaving (all methods for one prompt and repetition, in a rotating order) lets
machine drift hit every method alike. Every method first gets `warmup` untimed runs
on the first prompt (first-shape effects, the adaptive policy's calibration); then
each (prompt, mode, method) gets `reps` timed runs and the median is kept. In greedy mode every method's tokens are
compared with the baseline's: a mismatch is an error in float32/float64, and a
reported divergence in bf16/fp16, where batched and one-token passes round
differently.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from importlib import resources

import torch
from tqdm.auto import tqdm

from specdecode.bench.methods import BASELINE, Method, RunResult
from specdecode.core.probs import GREEDY, SamplingParams

SAMPLED = SamplingParams(temperature=0.7)
MODES = {"greedy": GREEDY, "sampled": SAMPLED}
PROMPT_SETS = ("codegen", "codeedit", "chat")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    sets: tuple[str, ...] = PROMPT_SETS
    prompts_per_set: int | None = None  # None = all
    modes: tuple[str, ...] = ("greedy", "sampled")
    reps: int = 3
    warmup: int = 1
    max_new_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.sets) - set(PROMPT_SETS)
        if unknown:
            raise ValueError(f"unknown prompt set(s) {sorted(unknown)}; choose from {', '.join(PROMPT_SETS)}")
        if set(self.modes) - set(MODES):
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {list(self.modes)}")
        if self.reps < 1 or self.warmup < 0 or self.max_new_tokens < 1:
            raise ValueError("reps >= 1, warmup >= 0 and max_new_tokens >= 1 are required")


@dataclass
class Cell:
    """All timed runs of one method on one prompt in one mode."""

    runs: list[RunResult] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(len(r.tokens) / r.seconds for r in self.runs)

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Median decode rate after the first tokens (None if a run cannot tell)."""
        rates = [r.decode_tokens_per_second for r in self.runs]
        return None if any(r is None for r in rates) else statistics.median(rates)


def load_prompts(name: str) -> list[dict]:
    return json.loads(resources.files("specdecode.bench").joinpath("prompts", f"{name}.json").read_text())


def run_benchmark(methods: list[Method], encode, config: BenchConfig, exact_dtype: bool,
                  progress: bool = True) -> dict:
    """Run everything; return {set: {mode: {prompt_id: {method: Cell}}}} plus correctness findings."""
    prompts = {s: load_prompts(s)[: config.prompts_per_set] for s in config.sets}
    total = (sum(len(p) for p in prompts.values()) * len(config.modes) * config.reps + config.warmup) * len(methods)
    results: dict = {}
    errors: list[str] = []
    divergences: list[str] = []
    bar = tqdm(total=total, desc="benchmark", disable=not progress, unit="run")
    rotation = 0  # each repetition starts the method order one place further: no method always goes first
    first = next(iter(prompts.values()))[0]
    warm_ids = encode(first["prompt"], first["chat"])
    for _ in range(config.warmup):
        for method in methods:
            bar.set_postfix_str(f"warm-up/{method.name}", refresh=False)
            method.run(warm_ids, MODES[config.modes[0]], config.seed, config.max_new_tokens)
            bar.update()
    for set_name, items in prompts.items():
        for mode in config.modes:
            sampling = MODES[mode]
            for item in items:
                ids = encode(item["prompt"], item["chat"])
                cells = {m.name: Cell() for m in methods}
                for rep in range(config.reps):
                    shift = rotation % len(methods)
                    rotation += 1
                    for method in methods[shift:] + methods[:shift]:
                        bar.set_postfix_str(f"{set_name}/{item['id']}/{mode}/{method.name}", refresh=False)
                        cells[method.name].runs.append(method.run(ids, sampling, config.seed + rep,
                                                                  config.max_new_tokens))
                        bar.update()
                if mode == "greedy":
                    _check_identity(cells, f"{set_name}/{item['id']}", exact_dtype, errors, divergences)
                results.setdefault(set_name, {}).setdefault(mode, {})[item["id"]] = cells
    bar.close()
    return {"cells": results, "errors": errors, "divergences": divergences}


def _check_identity(cells: dict[str, Cell], where: str, exact: bool, errors: list[str],
                    divergences: list[str]) -> None:
    reference = cells[BASELINE].runs[0].tokens
    for name, cell in cells.items():
        for run in cell.runs:
            if run.tokens == reference:
                continue
            at = next((i for i, (a, b) in enumerate(zip(run.tokens, reference)) if a != b),
                      min(len(run.tokens), len(reference)))
            message = f"{where}: '{name}' differs from the baseline from token {at}"
            (errors if exact else divergences).append(message)
            break


def exact_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.float64)
