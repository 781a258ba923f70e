"""Speculation against plain decoding on one decoder, pair by pair, with the time taken apart.

`specdecode bench` compares end-to-end rates per prompt, where one run's noise on this machine
(up to 8% between two identical plain decoders) hides a gap of a few percent. This script runs
the same request with and without speculation back to back (the order alternating per pair)
on one decoder and one llama.cpp target, and splits the decode time (after the first round) into:
- plain rounds: the one-token pass, and the drafters' time in rounds that end up drafting
  nothing (prompt lookup's look-up, the policy's choice);
- drafting rounds: their pass and draft time, and the tokens they emitted, priced against what
  the same tokens cost in one-token rounds;
- the rest: the engine's own bookkeeping per round (sampling, statistics, detokenising).

    python benchmarks/ab.py --sets codegen codeedit chat --out benchmarks/results/ab-MACHINE-DATE
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm import tqdm

from specdecode.bench.harness import PROMPT_SETS, load_prompts
from specdecode.bench.report import save
from specdecode.cli.generate import positive_int
from specdecode.core.probs import SamplingParams
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.stats import GenerationStats

MODES = {"greedy": 0.0, "sampled": 0.7}


def run_one(decoder: SpeculativeDecoder, ids: list[int], temperature: float, seed: int, max_new: int,
            speculative: bool) -> dict:
    config = GenerationConfig(max_new_tokens=max_new, sampling=SamplingParams(temperature=temperature), seed=seed)
    stats = GenerationStats()
    t0 = time.perf_counter()
    tokens = decoder.generate_ids(ids, config, stats=stats, speculative=speculative)
    wall = time.perf_counter() - t0
    first, rest = stats.rounds[0], stats.rounds[1:]
    plain = [r for r in rest if r.drafted == 0]
    drafting = [r for r in rest if r.drafted > 0]
    out = {"tokens": tokens, "decode_s": wall - stats.t_prefill - first.t_draft - first.t_verify,
           "decode_tokens": len(tokens) - first.emitted, "rounds": len(rest),
           "plain_rounds": len(plain), "plain_pass_s": sum(r.t_verify for r in plain),
           "plain_draft_s": sum(r.t_draft for r in plain),
           "drafting_rounds": len(drafting), "drafted": sum(r.drafted for r in drafting),
           "drafting_emitted": sum(r.emitted for r in drafting),
           "drafting_s": sum(r.t_verify + r.t_draft for r in drafting)}
    out["rest_s"] = out["decode_s"] - out["plain_pass_s"] - out["plain_draft_s"] - out["drafting_s"]
    return out


def summarise(runs: list[dict]) -> dict:
    total = lambda key: sum(r[key] for r in runs)  # noqa: E731
    rate = total("decode_tokens") / total("decode_s")
    one_token = total("plain_pass_s") / max(1, total("plain_rounds"))  # a plain round's pass
    return {"pairs": len(runs), "decode_tokens_per_s": rate, "rounds": total("rounds"),
            "plain_pass_ms": 1e3 * one_token,
            "drafters_ms_per_plain_round": 1e3 * total("plain_draft_s") / max(1, total("plain_rounds")),
            "rest_ms_per_round": 1e3 * total("rest_s") / max(1, total("rounds")),
            "drafting_rounds": total("drafting_rounds"), "drafted": total("drafted"),
            "drafting_emitted": total("drafting_emitted"), "drafting_s": total("drafting_s"),
            # what the drafting rounds' tokens would have cost in one-token rounds, minus what they cost
            "drafting_saved_s": total("drafting_emitted") * one_token - total("drafting_s"),
            "decode_s": total("decode_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", nargs="+", choices=sorted(PROMPT_SETS), default=["codegen"])
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES), default=sorted(MODES))
    ap.add_argument("--pairs", type=positive_int, default=1, help="pairs per prompt and mode")
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    ap.add_argument("--out", type=Path, help="folder for results.json and results.md")
    args = ap.parse_args()
    decoder = SpeculativeDecoder.load(progress=False)
    # a first request calibrates adaptive K's costs (or reads them from the cache), a one-time cost
    # that is not the decode rate's: run one untimed
    warm = load_prompts(args.sets[0])[0]
    run_one(decoder, decoder.encode(warm["prompt"], chat=warm.get("chat")), MODES[args.modes[0]], 0, 8, True)
    jobs = [(s, p, mode, pair) for pair in range(args.pairs) for mode in args.modes for s in args.sets
            for p in load_prompts(s)]
    runs: dict[tuple[str, str, bool], list[dict]] = {}
    same, pairs = 0, []
    for i, (s, prompt, mode, pair) in enumerate(tqdm(jobs, desc="pairs", unit="pair")):
        ids = decoder.encode(prompt["prompt"], chat=prompt.get("chat"))
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {spec: run_one(decoder, ids, MODES[mode], pair, args.max_new_tokens, spec) for spec in order}
        same += got[True]["tokens"] == got[False]["tokens"]
        for spec, run in got.items():
            runs.setdefault((s, mode, spec), []).append(run)
            pairs.append({"set": s, "id": prompt["id"], "mode": mode, "pair": pair, "auto": spec,
                          **{k: v for k, v in run.items() if k != "tokens"}})
    table = {f"{s} {mode} {'auto' if spec else 'plain'}": summarise(rs) for (s, mode, spec), rs in sorted(runs.items())}
    lines = ["| set, mode | plain tok/s | auto tok/s | auto / plain | one-token pass ms (plain, auto) | drafters ms "
             "per plain round | rest ms per round (plain, auto) | drafting rounds: rounds, drafted, emitted, "
             "saved s |", "|---|---|---|---|---|---|---|---|"]
    for s in args.sets:
        for mode in args.modes:
            a, b = table[f"{s} {mode} plain"], table[f"{s} {mode} auto"]
            lines.append(f"| {s} {mode} | {a['decode_tokens_per_s']:.2f} | {b['decode_tokens_per_s']:.2f} | "
                         f"{b['decode_tokens_per_s'] / a['decode_tokens_per_s']:.3f} | {a['plain_pass_ms']:.2f}, "
                         f"{b['plain_pass_ms']:.2f} | {b['drafters_ms_per_plain_round']:.3f} | "
                         f"{a['rest_ms_per_round']:.2f}, {b['rest_ms_per_round']:.2f} | {b['drafting_rounds']}, "
                         f"{b['drafted']}, {b['drafting_emitted']}, {b['drafting_saved_s']:+.2f} of "
                         f"{b['decode_s']:.1f} |")
    lines.append(f"\nOutputs equal in {same} of {len(jobs)} pairs (greedy parts only at kernel near-ties; "
                 f"sampled pairs share a seed, and speculation draws differently).")
    print("\n".join(lines))
    if args.out:
        save(args.out, {"args": vars(args) | {"out": str(args.out)}, "summary": table, "runs": pairs}, "\n".join(lines))


if __name__ == "__main__":
    main()
