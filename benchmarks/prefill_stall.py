"""How long running streams pause while a long prompt arrives, by the scheduler's prefill piece size.

Two requests decode (128 tokens each); after their first rounds a long prompt (a code file of
about 2,000 tokens, asked to be edited) joins. For each piece size (`--prefill-chunk`, the
scheduler's `prefill_tokens`; "whole" = the prompt in one round, the scheduler before chunked
prefill) it reports the longest pause between two rounds of the running streams, the long
request's time to first token, and the wall time until every request has ended. One decoder
(the embedded pair on llama.cpp, batch of 4); the piece sizes take turns, `--repeat` times.

    python benchmarks/prefill_stall.py --out benchmarks/results/prefill-stall-MACHINE-DATE
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from specdecode.bench.report import save
from specdecode.cli.generate import positive_int
from specdecode.core.probs import GREEDY
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.scheduler import SchedulerConfig

SHORT = ["Write a Python function that checks whether a string is a palindrome.",
         "Explain what a Python generator is, with a short example."]
FUNCTION = '''
def parse_record_{i}(line: str) -> dict:
    """Parse one line of the log into a record."""
    fields = line.strip().split(",")
    if len(fields) != 4:
        raise ValueError(f"bad line: {{line!r}}")
    stamp, level, source, message = fields
    return {{"stamp": float(stamp), "level": level.upper(), "source": source, "message": message}}
'''
LONG = "Rename every parse_record function to read_record and keep everything else as it is:\n" + \
    "".join(FUNCTION.format(i=i) for i in range(24))
WHOLE = 10 ** 9  # a piece bigger than any prompt: the prompt in one round


def run(decoder: SpeculativeDecoder, piece: int, max_new: int) -> dict:
    decoder.set_scheduling(SchedulerConfig(prefill_tokens=piece))
    config = GenerationConfig(max_new_tokens=max_new, sampling=GREEDY)
    for i, prompt in enumerate(SHORT):
        decoder.add_request(decoder.encode(prompt, chat=True), config, key=i)
    long_ids = decoder.encode(LONG, chat=True)
    t0, rounds, t_admit, t_first = time.perf_counter(), [], None, None
    while decoder.scheduler.running:
        if len(rounds) == 4 and t_admit is None:  # the streams run: the long prompt arrives
            decoder.add_request(long_ids, config, key="long")
            t_admit = time.perf_counter()
        t1 = time.perf_counter()
        got = [(r, r.take()) for r in decoder.step()]
        t2 = time.perf_counter()
        if any(r.key != "long" for r, _ in got):
            rounds.append((t1, t2))
        if t_first is None and any(r.key == "long" and any(c.tokens for c in chunks) for r, chunks in got):
            t_first = t2 - t_admit
    gaps = [b[1] - a[1] for a, b in zip(rounds, rounds[1:])]  # between two rounds the streams got tokens
    return {"piece": "whole" if piece == WHOLE else piece, "prompt_tokens": len(long_ids),
            "longest_pause_s": max(gaps), "median_round_s": statistics.median(gaps),
            "long_ttft_s": t_first, "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pieces", nargs="+", type=positive_int, default=[128, 256, 512],
                    help="piece sizes to try (the whole prompt in one round is always tried too)")
    ap.add_argument("--repeat", type=positive_int, default=2)
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--out", type=Path, help="folder for results.json and results.md")
    args = ap.parse_args()
    decoder = SpeculativeDecoder.load(max_batch=4, progress=False)
    pieces = [*args.pieces, WHOLE]
    runs = []
    for r in tqdm(range(args.repeat), desc="repeats"):
        for piece in pieces[r % len(pieces):] + pieces[:r % len(pieces)]:  # rotate the order
            runs.append(run(decoder, piece, args.max_new_tokens))
    lines = [f"Long prompt: {runs[0]['prompt_tokens']} tokens; medians of {args.repeat} runs.\n",
             "| prompt piece per round | longest pause of the running streams (s) | their median round (s) | "
             "long prompt's time to first token (s) | wall time, all three (s) |", "|---|---|---|---|---|"]
    for piece in pieces:
        mine = [r for r in runs if r["piece"] == ("whole" if piece == WHOLE else piece)]
        med = lambda key: statistics.median(r[key] for r in mine)  # noqa: E731
        lines.append(f"| {mine[0]['piece']} | {med('longest_pause_s'):.2f} | {med('median_round_s'):.3f} | "
                     f"{med('long_ttft_s'):.2f} | {med('wall_s'):.1f} |")
    print("\n".join(lines))
    if args.out:
        save(args.out, {"args": vars(args) | {"out": str(args.out)}, "runs": runs}, "\n".join(lines))


if __name__ == "__main__":
    main()
