"""The verification-cost frontier: what a target pass over n = 1..16 tokens costs, per kernel setting.

Speculation pays only where a pass over K+1 tokens costs little more than one token. This
measures that curve for llama.cpp on the embedded GGUF target (by threads, flash attention
and batch size) and the draft's one-token step, with every size timed in interleaved sweeps
(median of `--sweeps`), after a 200-token context. Serving meets a second curve: B one-token
rows of B sequences sharing one context (a unified KV cache), each after `--batch-context`
tokens, which is what flash attention changes most. Run it with nothing else on the machine:

    python benchmarks/frontier.py --out benchmarks/results/frontier

The PyTorch kernels' per-M table (bf16, int8/int4 weight-only, w8a8) comes from
`shared/tools/matmul_by_m.py` and is quoted in the README beside this one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode.backends.llamacpp import LlamaCppModel, LlamaSettings, LlamaWeights, default_threads
from specdecode.backends.protocol import Row, forward_batch
from specdecode.backends.weights import DRAFT, TARGET, ensure_gguf
from specdecode.engine.calibration import interleaved_medians, time_pass

SIZES = list(range(1, 17))
BATCHES = [1, 2, 3, 4]


def curve(model: LlamaCppModel, context: list[int], sweeps: int) -> list[float]:
    model.truncate(0)
    model.forward(context, n_logits=1)
    medians = interleaved_medians({n: (lambda n=n: time_pass(model, context[-1], n)) for n in SIZES}, sweeps)
    return [medians[n] for n in SIZES]


def batch_curve(weights: LlamaWeights, flash_attn: bool, context: list[int], sweeps: int) -> list[float]:
    """Seconds of one pass over B one-token rows (B = 1..4 sequences of one context), each
    sequence after `context`: the decode rows of a batched server."""
    first = LlamaCppModel(weights, LlamaSettings(n_seq_max=max(BATCHES), flash_attn=flash_attn))
    models = [first] + [first.sibling() for _ in BATCHES[1:]]
    for model in models:
        model.forward(context, n_logits=1)

    def timed(b: int) -> float:
        t0 = time.perf_counter()
        forward_batch([Row(m, [context[-1]], 1) for m in models[:b]])
        elapsed = time.perf_counter() - t0
        for m in models[:b]:
            m.truncate(len(context))
        return elapsed

    medians = interleaved_medians({b: (lambda b=b: timed(b)) for b in BATCHES}, sweeps)
    return [medians[b] for b in BATCHES]


def table(title: str, sizes: list[int], rows: dict[str, list[float]]) -> list[str]:
    lines = [f"# {title} (ms; ratio to one token)", "",
             "| setting | " + " | ".join(str(n) for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for name, ts in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{1000 * t:.0f} ({t / ts[0]:.2f})" for t in ts) + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweeps", type=int, default=5)
    ap.add_argument("--batch-context", type=int, nargs="+", default=[200, 800],
                    help="context lengths per sequence for the batched curve")
    ap.add_argument("--out", default="benchmarks/results/frontier")
    args = ap.parse_args()
    cores = default_threads()
    target = LlamaWeights(ensure_gguf(TARGET, progress=False), "target")
    draft = LlamaWeights(ensure_gguf(DRAFT, progress=False), "draft")
    context = [(i * 7919) % 20000 + 100 for i in range(200)]  # any ids: costs do not depend on them
    settings = {f"threads={t}, flash_attn={fa}, n_batch={nb}": LlamaSettings(n_ctx=1024, n_threads=t, flash_attn=fa,
                                                                              n_batch=nb)
                for t in sorted({1, cores}) for fa in (False, True) for nb in (512,)}
    settings[f"threads={cores}, flash_attn=False, n_batch=8"] = LlamaSettings(
        n_ctx=1024, n_threads=cores, n_batch=8, flash_attn=False, tree_leaves=0)  # llama.cpp: n_batch >= sequence ids
    rows = {}
    for name, s in settings.items():
        rows[f"target {name}"] = curve(LlamaCppModel(target, s), context, args.sweeps)
        print(f"target {name}: " + ", ".join(f"{1000 * t:.0f}" for t in rows[f"target {name}"]), flush=True)
    for t in sorted({1, cores}):
        name = f"draft threads={t}, flash_attn=False"
        rows[name] = curve(LlamaCppModel(draft, LlamaSettings(n_ctx=1024, n_threads=t, flash_attn=False)), context,
                           args.sweeps)
        print(f"{name}: " + ", ".join(f"{1000 * x:.0f}" for x in rows[name]), flush=True)

    batched = {}
    for n in args.batch_context:
        for fa in (False, True):
            name = f"target, {n}-token contexts, flash_attn={fa}"
            batched[name] = batch_curve(target, fa, context * (n // len(context)) + context[:n % len(context)],
                                        args.sweeps)
            print(f"{name}: " + ", ".join(f"{1000 * t:.0f}" for t in batched[name]), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps({"sizes": SIZES, "seconds": rows, "batches": BATCHES,
                                                   "batched_seconds": batched}, indent=1))
    lines = table("llama.cpp pass cost by tokens in the pass", SIZES, rows) + \
        table(f"llama.cpp pass over B one-token rows of B sequences ({cores} threads)", BATCHES, batched)
    (out / "frontier.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
