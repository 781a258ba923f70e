"""The draft model's step cost alone and with the batch's rows in one pass (`draft_together`).

Four code prompts, the draft model as the only drafter, K = 3, greedy: each prompt alone, then
the four batched (`generate_many`, max batch 4). Every pass of the draft model is timed; reports
the median one-row draft step alone and the median batched step by its rows (1-4: rows leave as
their sequences finish), and whether each batched output equals its solo run (on llama.cpp a
batched pass rounds differently, so a near-tie may part).

    python benchmarks/draft_steps.py
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdecode.cli.generate import positive_int
from specdecode.core.probs import GREEDY
from specdecode.drafters import model as draft_model
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder

PROMPTS = ["def fibonacci(n):", "Write a Python function that reverses a string.",
           "class Stack:\n    def __init__(self):", "import numpy as np\n\ndef normalize(x):"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=positive_int, default=48)
    ap.add_argument("--k", type=positive_int, default=3, help="draft tokens per round (fixed)")
    args = ap.parse_args()
    decoder = SpeculativeDecoder.load(drafter="model", max_batch=len(PROMPTS), progress=False)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=GREEDY, k=args.k)
    passes: list[tuple[int, int, float]] = []  # rows, longest row, seconds
    real = draft_model.forward_batch

    def timed(rows):
        t0 = time.perf_counter()
        out = real(rows)
        passes.append((len(rows), max(len(r.tokens) for r in rows), time.perf_counter() - t0))
        return out

    draft_model.forward_batch = timed
    solo = [decoder.generate(p, config) for p in PROMPTS]
    alone = [t for n, longest, t in passes if n == 1 and longest <= 2]  # draft steps, not catch-ups
    passes.clear()
    batched = decoder.generate_many(PROMPTS, [config] * len(PROMPTS))
    print(f"draft step, one row alone: median {1e3 * statistics.median(alone):.1f} ms over {len(alone)} steps")
    for rows in range(1, len(PROMPTS) + 1):  # T_d(rows), the lockstep step cost adaptive K prices a batch's drafts by
        steps = [t for n, longest, t in passes if n == rows and longest <= 2]
        if steps:
            print(f"draft step, {rows} row(s) in one batched pass: median {1e3 * statistics.median(steps):.1f} ms "
                  f"over {len(steps)} steps ({1e3 * statistics.median(steps) / rows:.1f} ms a row)")
    print("batched output equals its solo run:", [b.tokens == s.tokens for b, s in zip(batched, solo)])


if __name__ == "__main__":
    main()
