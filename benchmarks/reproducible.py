"""What reproducible sampling costs in acceptance, against the default (rejection) rule.

The same prompts, seeds, fixed K and draft model, sampled at several temperatures, once with
the default rule and once with `reproducible=True`; reports accepted drafts per drafted token
and tokens per round for each. Both runs have the target's law; only the acceptance differs.

    python benchmarks/reproducible.py --prompts-per-set 3 --out benchmarks/results/reproducible-MACHINE-DATE
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.bench.harness import load_prompts
from specdecode.core.probs import SamplingParams
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.stats import GenerationStats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-per-set", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    decoder = SpeculativeDecoder.load(drafter="model")
    items = [i for name in ("codegen", "chat") for i in load_prompts(name)[:args.prompts_per_set]]
    rows = []
    for temperature in args.temperatures:
        totals = {False: [0, 0, 0, 0], True: [0, 0, 0, 0]}  # drafted, accepted, tokens, rounds
        for item in items:
            ids = decoder.encode(item["prompt"], item["chat"])
            for seed in range(args.seeds):
                for reproducible in (False, True):  # interleaved
                    config = GenerationConfig(max_new_tokens=args.max_new_tokens, k=args.k, seed=seed,
                                              sampling=SamplingParams(temperature=temperature),
                                              reproducible=reproducible)
                    stats = GenerationStats()
                    decoder.generate_ids(ids, config, stats=stats)
                    t = totals[reproducible]
                    t[0] += stats.drafted
                    t[1] += stats.accepted
                    t[2] += stats.new_tokens
                    t[3] += stats.num_rounds
        for reproducible, (drafted, accepted, tokens, rounds) in totals.items():
            row = {"temperature": temperature, "mode": "reproducible" if reproducible else "default rule",
                   "accepted_per_draft": accepted / max(1, drafted), "tokens_per_round": tokens / max(1, rounds),
                   "drafted": drafted}
            rows.append(row)
            print(f"T={temperature}  {row['mode']:13s}  accepted/drafted {row['accepted_per_draft']:.3f}  "
                  f"tokens/round {row['tokens_per_round']:.2f}  ({drafted} drafts)", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "reproducible.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
