"""Turn benchmark cells into numbers: speedups, theory's prediction, efficiency; then md/json/png."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from specdecode.bench.harness import Cell
from specdecode.bench.methods import BASELINE, PLAIN_DECODERS
from specdecode.core.theory import expected_tokens
from specdecode.engine.stats import GenerationStats


def predicted_speedup(stats: GenerationStats, curve: list[float]) -> float | None:
    """What theory predicts for this run's rounds from its measured alpha and costs.

    Per drafter: alpha = accepted / tested, draft step = draft time / drafted tokens.
    Expected tokens = sum over rounds of E[N](alpha, K_r) (1 for a plain step); expected time
    = sum of T_verify(tokens verified) + K_r * step, with T from the measured cost curve.
    Relative to plain decoding, which makes 1 token per T_verify(1).
    """
    if not stats.rounds:
        return None
    per: dict[str, list[float]] = {}
    for r in stats.rounds:
        if r.drafted:
            acc = per.setdefault(r.drafter, [0.0, 0.0, 0.0, 0.0])
            acc[0] += r.accepted
            acc[1] += min(r.accepted + 1, r.drafted)
            acc[2] += r.t_draft
            acc[3] += r.drafted
    tokens = time = 0.0
    for r in stats.rounds:
        size = max(1, r.verified)
        if size > len(curve):
            return None
        if r.drafted:
            accepted, tested, t_draft, drafted = per[r.drafter]
            tokens += expected_tokens(min(1.0, accepted / tested), r.drafted)
            time += curve[size - 1] + r.drafted * t_draft / drafted
        else:
            tokens += 1
            time += curve[size - 1]
    return tokens / time * curve[0]


def summarise(bench: dict, curve: list[float]) -> dict:
    """{set: {mode: {method: metrics}}}: geometric means over prompts, pooled acceptance counts."""
    out: dict = {}
    for set_name, modes in bench["cells"].items():
        for mode, prompts in modes.items():
            methods = next(iter(prompts.values())).keys()
            row: dict = {}
            plains = [m for m in methods if m in PLAIN_DECODERS]
            for method in methods:
                cells = [prompts[p][method] for p in prompts]
                base = [prompts[p][BASELINE] for p in prompts]
                row[method] = _metrics(cells, base, curve)
                # against the fastest plain decoder measured on each prompt (ours, llama.cpp's, HF's)
                row[method]["vs_fastest_plain"] = _geomean([
                    prompts[p][method].tokens_per_second / max(prompts[p][m].tokens_per_second for m in plains)
                    for p in prompts])
                # the same on decode rates (after the first tokens): outputs of different lengths
                # amortise the prefill differently, which moves end-to-end rates by several percent
                row[method]["decode_vs_fastest_plain"] = _ratio_to_best(
                    [(prompts[p][method].decode_tokens_per_second,
                      [prompts[p][m].decode_tokens_per_second for m in plains]) for p in prompts])
            if "hf assisted" in row:
                for metrics in row.values():
                    metrics["vs_hf_assisted"] = metrics["speedup"] / row["hf assisted"]["speedup"]
            out.setdefault(set_name, {})[mode] = row
    return out


def _metrics(cells: list[Cell], base: list[Cell], curve: list[float]) -> dict:
    speedups = [c.tokens_per_second / b.tokens_per_second for c, b in zip(cells, base)]
    decode = [c.decode_tokens_per_second for c in cells]
    m = {"tokens_per_s": statistics.median(c.tokens_per_second for c in cells), "speedup": _geomean(speedups),
         "decode_tokens_per_s": None if None in decode else statistics.median(decode)}
    runs = [r for c in cells for r in c.runs if r.stats is not None]
    if not runs or not any(r.stats.drafted for r in runs):
        return m
    pooled = GenerationStats()  # every round of every run: the per-request definitions, pooled
    for r in runs:
        for record in r.stats.rounds:
            pooled.add_round(record)
    predicted = [p for p in (predicted_speedup(r.stats, curve) for r in runs) if p]
    m.update({
        "alpha": pooled.alpha,
        "per_position": [a / t if t else None
                         for a, t in zip(pooled.accepted_per_position, pooled.reached_per_position)],
        "mean_acceptance_length": pooled.mean_acceptance_length,
        "mean_k": statistics.mean(pooled.k_per_round),  # plain (K = 0) rounds included
        # tokens each verification pass ran for this request (pending + drafts or tree nodes + padding):
        # what tokens/round is bought with (trees are compared with chains at the same pass size)
        "pass_tokens": statistics.mean(max(1, r.verified) for r in pooled.rounds),
        "off_chain_rounds": pooled.off_chain_rounds / len(pooled.rounds),
        "c": pooled.c,
        "predicted": _geomean(predicted) if predicted else None,
    })
    m["efficiency"] = m["speedup"] / m["predicted"] if m["predicted"] else None
    return m


def _ratio_to_best(pairs: list[tuple[float | None, list[float | None]]]) -> float | None:
    """Geometric mean over prompts of rate / the best of `others` (None if any rate is unknown)."""
    ratios = []
    for rate, others in pairs:
        known = [o for o in others if o is not None]
        if rate is None or not known:
            return None
        ratios.append(rate / max(known))
    return _geomean(ratios)


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# Benchmark: {meta['target']} + {meta['draft']}", "",
             f"`{meta['command']}` on {meta['machine']}, dtype {meta['dtype']}, {meta['max_new_tokens']} new "
             f"tokens, {meta['reps']} timed repetition(s) per cell (median), after {meta['warmup']} untimed warm-up "
             f"pass(es) of every method.", "",
             "Speedup = tokens/s over our plain decoding; vs fastest plain = over the fastest plain decoder "
             "measured on each prompt (ours, llama.cpp's or Hugging Face's; geometric means over prompts, same run). "
             "Decode = the same after the first tokens (prefill and first pass excluded), which outputs of "
             "different lengths do not bias. "
             "Predicted = the documents' formula with this run's measured alpha, draft step time and target "
             "cost curve; efficiency = measured / predicted. Tokens/pass run = the tokens each verification "
             "pass ran (pending + drafts or tree nodes): a tree is compared with the chain of the same pass size.", "",
             "Target cost curve (ms per pass over n tokens): "
             + ", ".join(f"{n}: {1000 * t:.0f}" for n, t in enumerate(meta["cost_curve"], start=1)), ""]
    for set_name, modes in summary.items():
        for mode, rows in modes.items():
            lines += [f"## {set_name}, {mode}", "",
                      "| method | tok/s | speedup | vs fastest plain | decode tok/s | decode vs fastest plain "
                      "| vs HF assisted | alpha | tokens/round | tokens/pass run | mean K | c | predicted | efficiency |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for name, m in rows.items():
                lines.append(f"| {name} | {m['tokens_per_s']:.2f} | {m['speedup']:.2f}x | "
                             f"{m['vs_fastest_plain']:.2f}x | {_f(m.get('decode_tokens_per_s'))} | "
                             f"{_f(m.get('decode_vs_fastest_plain'), '{:.2f}x')} | {_f(m.get('vs_hf_assisted'))} | {_f(m.get('alpha'), '{:.3f}')} | "
                             f"{_f(m.get('mean_acceptance_length'))} | {_f(m.get('pass_tokens'))} | "
                             f"{_f(m.get('mean_k'))} | {_f(m.get('c'))} | "
                             f"{_f(m.get('predicted'))} | {_f(m.get('efficiency'))} |")
            lines.append("")
    if meta.get("errors"):
        lines += ["## ERRORS (greedy outputs that differ from the baseline in an exact dtype)", ""]
        lines += [f"- {e}" for e in meta["errors"]] + [""]
    if meta.get("divergences"):
        lines += [f"## Divergences in {meta['dtype']} (numerics of batched vs one-token passes)", ""]
        lines += [f"- {d}" for d in meta["divergences"]] + [""]
    return "\n".join(lines)


def plot(summary: dict, k_sweep: list[int], path: Path, mode: str = "greedy") -> None:
    """Speedup vs K: measured (solid) and predicted (dashed), one colour per prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (set_name, modes) in enumerate(summary.items()):
        rows = modes.get(mode) or next(iter(modes.values()))
        ks = [k for k in k_sweep if f"model K={k}" in rows]
        color = f"C{i}"
        ax.plot(ks, [rows[f"model K={k}"]["speedup"] for k in ks], "o-", color=color, label=f"{set_name} measured")
        ax.plot(ks, [rows[f"model K={k}"].get("predicted") or float("nan") for k in ks], "s--", color=color,
                alpha=0.6, label=f"{set_name} predicted")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(k_sweep)
    ax.set_xlabel("K (draft tokens per round, draft model)")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title(f"Speculative decoding, {mode}: measured vs predicted")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(out: Path, data: dict, table: str) -> None:
    """A benchmark script's results in `out`: results.json (the data) and results.md (the table)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=1))
    (out / "results.md").write_text(table + "\n")
