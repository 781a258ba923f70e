"""Requests that repeat earlier ones: what the suffix drafter's cross-request history buys.

Agents, retries and templated jobs send requests whose answers repeat earlier answers. This
runs every prompt twice in a row (the second ask is what is measured) with plain decoding,
prompt lookup and the suffix drafter, each with its own decoder on one shared target, the
methods interleaved prompt by prompt, and reports decode tokens/s (after the first tokens)
of the second ask against plain decoding. Sampled asks use different seeds, so the second
answer is a new sample, not a copy of the first (greedy asks repeat the same answer).

    python benchmarks/repeat.py --prompts-per-set 3 --out benchmarks/results/repeat-MACHINE-DATE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdecode.bench.harness import MODES, PROMPT_SETS, load_prompts
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.stats import GenerationStats


def decode_rate(decoder: SpeculativeDecoder, ids: list[int], config: GenerationConfig, speculative: bool) -> dict:
    stats = GenerationStats()
    t0 = time.perf_counter()
    tokens = decoder.generate_ids(ids, config, stats=stats, speculative=speculative)
    seconds = time.perf_counter() - t0
    first = stats.rounds[0]
    t_first = stats.t_prefill + first.t_draft + first.t_verify
    return {"tokens": len(tokens), "ids": tokens, "decode_tok_s": (len(tokens) - first.emitted) / (seconds - t_first),
            "tokens_per_round": len(tokens) / len(stats.rounds), "tree_rounds": len(stats.tree_rounds),
            "off_chain_rounds": stats.off_chain_rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", default=list(PROMPT_SETS))
    ap.add_argument("--prompts-per-set", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=["greedy", "sampled"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench-out/repeat")
    args = ap.parse_args()

    base = SpeculativeDecoder.load(drafter="lookup", progress=False)
    decoders = {"plain": base,
                "lookup": base,
                "suffix": SpeculativeDecoder(base.target, base.tokenizer, [SuffixDrafter()], eos_ids=base.eos_ids,
                                             calibration=base.calibration)}
    first = load_prompts(args.sets[0])[0]
    warm = base.encode(first["prompt"], chat=first["chat"])
    for decoder in (base, decoders["suffix"]):
        decoder.calibrate(warm)  # cached costs (or measured now), outside the timed runs
    assert isinstance(base.drafters[0], LookupDrafter)
    rows: dict = {}
    for name in args.sets:
        for mode in args.modes:
            for item in load_prompts(name)[: args.prompts_per_set]:
                ids = base.encode(item["prompt"], chat=item["chat"])
                for method, decoder in decoders.items():
                    results = [decode_rate(decoder, ids, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                                          sampling=MODES[mode], seed=ask),
                                           speculative=method != "plain") for ask in (0, 1)]
                    rows.setdefault((name, mode), {}).setdefault(method, []).append(results[1])
                print(f"{name}/{mode}/{item['id']}: " + ", ".join(
                    f"{m} {r[-1]['decode_tok_s']:.1f} tok/s ({r[-1]['tokens_per_round']:.2f}/round)"
                    for m, r in rows[(name, mode)].items()), flush=True)

    lines = ["# Repeated requests: the second ask, decode tokens/s (after the first tokens)", "",
             "| set, mode | plain | lookup | suffix (history) | suffix vs plain | suffix tokens/round |",
             "|---|---|---|---|---|---|"]
    report = {}
    for (name, mode), methods in rows.items():
        ratio = statistics.geometric_mean([s["decode_tok_s"] / p["decode_tok_s"]
                                           for s, p in zip(methods["suffix"], methods["plain"])])
        med = {m: statistics.median(r["decode_tok_s"] for r in rs) for m, rs in methods.items()}
        per_round = statistics.mean(r["tokens_per_round"] for r in methods["suffix"])
        report[f"{name}/{mode}"] = {"median_decode_tok_s": med, "suffix_vs_plain": ratio,
                                    "suffix_tokens_per_round": per_round}
        lines.append(f"| {name}, {mode} | {med['plain']:.1f} | {med['lookup']:.1f} | {med['suffix']:.1f} | "
                     f"{ratio:.2f}x | {per_round:.2f} |")
    lines += ["", f"Command: `python benchmarks/repeat.py --prompts-per-set {args.prompts_per_set}`",
              f"Suffix drafter memory after the run: {decoders['suffix'].drafters[0].memory}"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "repeat.json").write_text(json.dumps(report, indent=1))
    (out / "repeat.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
