"""How fast prompt lookup could ever be on this machine: an oracle bound from the measured cost curve.

For greedy decoding the target's output is fixed, so for every round we know in hindsight how
many of the lookup drafter's proposed tokens the target would accept (a). An oracle that drafts
exactly those a tokens (K = a, or a plain step when a = 0) emits a + 1 tokens for one pass of
a + 1 tokens, and no policy that uses this drafter does better (a longer draft only adds cost,
a shorter one forgoes tokens the pass would have given almost for free). Its speedup over plain
decoding, sum of tokens * T(1) / sum of T(K + 1), decode only (the prefill is the same for all),
bounds what adaptive K can reach with prompt lookup on this target, backend and machine.

    python benchmarks/lookup_bound.py --prompts-per-set 8 --out benchmarks/results/lookup_bound

It also reports the acceptance of lookup's drafts by the length of the match they continue
(a long match is copying: its drafts are accepted far more often).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from specdecode.bench.harness import PROMPT_SETS, load_prompts
from specdecode.drafters.lookup import LookupConfig, NgramIndex
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder

MATCH_BUCKETS = ((2, 3), (4, 7), (8, 15), (16, 10**9))


def match_length(index: NgramIndex, cap: int = 64) -> int:
    """How many tokens the context's tail shares with the earlier text lookup copies from."""
    tokens, n = index.tokens, len(index.tokens)
    for size in range(min(index.config.max_n, n), index.config.min_n - 1, -1):
        end = index.last_end(tuple(tokens[n - size:]))
        if end is not None:
            length = 0
            while length < cap and end - length >= 0 and tokens[end - length] == tokens[n - 1 - length]:
                length += 1
            return length
    return 0


def replay(prompt: list[int], output: list[int], curve: dict[int, float], k_max: int) -> dict:
    """Walk the greedy output as the oracle would; return its time, plain time and acceptance by match."""
    index = NgramIndex(LookupConfig(max_proposal=k_max))
    index.extend(prompt)
    i, t_oracle, by_bucket = 0, 0.0, defaultdict(lambda: [0, 0])
    while i < len(output):
        proposal = index.propose(min(k_max, len(output) - i - 1))
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == output[i + accepted]:
            accepted += 1
        if proposal:
            length = match_length(index)
            bucket = next(b for b in MATCH_BUCKETS if b[0] <= length <= b[1])
            by_bucket[bucket][0] += accepted
            by_bucket[bucket][1] += min(accepted + 1, len(proposal))  # positions tested
        t_oracle += min(curve[m] for m in range(accepted + 1, k_max + 2))  # padding to a cheaper size allowed
        index.extend(output[i: i + accepted + 1])
        i += accepted + 1
    return {"t_oracle": t_oracle, "t_plain": len(output) * curve[1], "by_bucket": by_bucket}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", default=list(PROMPT_SETS))
    ap.add_argument("--prompts-per-set", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/results/lookup_bound")
    args = ap.parse_args()

    decoder = SpeculativeDecoder.load(drafter="lookup", progress=False)
    k_max = decoder.policy.k_max
    first = load_prompts(args.sets[0])[0]
    decoder.calibrate(decoder.encode(first["prompt"], chat=first["chat"]))  # the cached curve, or measure it
    curve = decoder.policy.t_verify
    rows, buckets = {}, defaultdict(lambda: [0, 0])
    for name in args.sets:
        ratios = []
        for item in load_prompts(name)[: args.prompts_per_set]:
            ids = decoder.encode(item["prompt"], chat=item["chat"])
            output = decoder.generate_ids(ids, GenerationConfig(max_new_tokens=args.max_new_tokens),
                                          speculative=False)
            r = replay(ids, output, curve, k_max)
            ratios.append(r["t_plain"] / r["t_oracle"])
            for b, (a, t) in r["by_bucket"].items():
                buckets[(name, b)][0] += a
                buckets[(name, b)][1] += t
            print(f"{name}/{item['id']}: oracle lookup {ratios[-1]:.3f}x plain (decode only)", flush=True)
        rows[name] = {"geomean": statistics.geometric_mean(ratios), "min": min(ratios), "max": max(ratios)}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    label = lambda b: f"{b[0]}-{b[1]}" if b[1] < 10**9 else f">={b[0]}"  # noqa: E731
    acceptance = {name: {label(b): {"alpha": a / t, "tested": t} for (s, b), (a, t) in sorted(buckets.items())
                         if s == name and t} for name in args.sets}
    (out / "lookup_bound.json").write_text(json.dumps({"curve_ms": {n: 1000 * t for n, t in curve.items()},
                                                       "oracle": rows, "acceptance_by_match": acceptance}, indent=1))
    lines = ["# Prompt lookup's oracle bound on this machine (greedy, decode only)", "",
             "Target cost curve (ms): " + ", ".join(f"{n}: {1000 * t:.0f}" for n, t in sorted(curve.items())), "",
             "| set | oracle lookup vs plain (geomean) | min | max |", "|---|---|---|---|"]
    lines += [f"| {s} | {r['geomean']:.3f}x | {r['min']:.3f}x | {r['max']:.3f}x |" for s, r in rows.items()]
    lines += ["", "Acceptance of lookup's drafts by the length of the match they continue (tokens):", "",
              "| set | " + " | ".join(label(b) for b in MATCH_BUCKETS) + " |", "|---|" + "---|" * len(MATCH_BUCKETS)]
    for s in args.sets:
        cells = [acceptance[s].get(label(b)) for b in MATCH_BUCKETS]
        lines.append(f"| {s} | " + " | ".join(f"{c['alpha']:.2f} ({c['tested']})" if c else "-" for c in cells)
                     + " |")
    lines += ["", f"Command: `python benchmarks/lookup_bound.py --prompts-per-set {args.prompts_per_set}`"]
    (out / "lookup_bound.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
