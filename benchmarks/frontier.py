"""The verification-cost frontier: what a target pass over n = 1..16 tokens costs, per kernel setting.

Speculation pays only where a pass over K+1 tokens costs little more than one token. This
measures that curve for llama.cpp on the embedded GGUF target (by threads, flash attention
and batch size) and the draft's one-token step, with every size timed in interleaved sweeps
(median of `--sweeps`), after a 200-token context. Run it with nothing else on the machine:

    python benchmarks/frontier.py --out benchmarks/results/frontier

The PyTorch kernels' per-M table (bf16, int8/int4 weight-only, w8a8) comes from
`shared/tools/matmul_by_m.py` and is quoted in the README beside this one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode.backends.llamacpp import LlamaCppModel, LlamaSettings, LlamaWeights, default_threads
from specdecode.backends.weights import DRAFT, TARGET, ensure_gguf
from specdecode.engine.loop import time_pass
from specdecode.engine.policy import interleaved_medians

SIZES = list(range(1, 17))


def curve(model: LlamaCppModel, context: list[int], sweeps: int) -> list[float]:
    model.truncate(0)
    model.forward(context, n_logits=1)
    medians = interleaved_medians({n: (lambda n=n: time_pass(model, context[-1], n)) for n in SIZES}, sweeps)
    return [medians[n] for n in SIZES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweeps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/frontier")
    args = ap.parse_args()
    cores = default_threads()
    target = LlamaWeights(ensure_gguf(TARGET, progress=False), "target")
    draft = LlamaWeights(ensure_gguf(DRAFT, progress=False), "draft")
    context = [(i * 7919) % 20000 + 100 for i in range(200)]  # any ids: costs do not depend on them
    settings = {f"threads={t}, flash_attn={fa}, n_batch={nb}": LlamaSettings(n_ctx=1024, n_threads=t, flash_attn=fa,
                                                                              n_batch=nb)
                for t in sorted({1, cores}) for fa in (False, True) for nb in (512,)}
    settings[f"threads={cores}, flash_attn=False, n_batch=8"] = LlamaSettings(n_ctx=1024, n_threads=cores, n_batch=8)
    rows = {}
    for name, s in settings.items():
        rows[f"target {name}"] = curve(LlamaCppModel(target, s), context, args.sweeps)
        print(f"target {name}: " + ", ".join(f"{1000 * t:.0f}" for t in rows[f"target {name}"]), flush=True)
    for t in sorted({1, cores}):
        name = f"draft threads={t}"
        rows[name] = curve(LlamaCppModel(draft, LlamaSettings(n_ctx=1024, n_threads=t)), context, args.sweeps)
        print(f"{name}: " + ", ".join(f"{1000 * x:.0f}" for x in rows[name]), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps({"sizes": SIZES, "seconds": rows}, indent=1))
    lines = ["# llama.cpp pass cost by tokens in the pass (ms; ratio to a one-token pass)", "",
             "| setting | " + " | ".join(str(n) for n in SIZES) + " |", "|---" * (len(SIZES) + 1) + "|"]
    for name, ts in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{1000 * t:.0f} ({t / ts[0]:.2f})" for t in ts) + " |")
    (out / "frontier.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
