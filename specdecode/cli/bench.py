"""`specdecode bench`: our methods vs plain decoding vs Hugging Face, measured side by side."""

from __future__ import annotations

import argparse
import copy
import json
import platform
import shlex
from pathlib import Path

from specdecode.cli.generate import add_model_args, positive_int
from specdecode.cli.output import console, emit_json


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark speculative decoding against plain decoding and HF",
                       description="Run plain decoding, our speculative methods (K sweep, adaptive, lookup, "
                                   "auto) and Hugging Face generate (plain, assisted, prompt lookup) interleaved "
                                   "on the prompt sets; write results.json, results.md and speedup.png.")
    add_model_args(p)
    p.add_argument("--quick", action="store_true",
                   help="one prompt per set, greedy, K in {2, 4}, 1 repetition, 32 tokens (a few minutes)")
    p.add_argument("--sets", nargs="+", default=None, help="prompt sets (codegen codeedit chat)")
    p.add_argument("--prompts-per-set", type=positive_int, default=None, help="use the first N prompts of each set")
    p.add_argument("--modes", nargs="+", default=None, help="greedy and/or sampled (temperature 0.7)")
    p.add_argument("--k-sweep", type=positive_int, nargs="+", default=None, help="fixed K values (default 1..8)")
    p.add_argument("--reps", type=positive_int, default=None, help="timed repetitions per cell (default 3)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="tokens per generation (default 128)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face generate() methods")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out/)")
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from specdecode.backends.hf import HFModel, resolve_device, resolve_dtype
    from specdecode.backends.weights import load_model
    from specdecode.bench.harness import PROMPT_SETS, BenchConfig, exact_dtype, measure_cost_curve, run_benchmark
    from specdecode.bench.methods import hf_methods, our_methods
    from specdecode.bench.report import markdown, plot, summarise
    from specdecode.engine.decoder import SpeculativeDecoder, check_compatible, make_cheaper

    quick = args.quick
    k_sweep = args.k_sweep or ([2, 4] if quick else list(range(1, 9)))
    if any(k < 1 for k in k_sweep):
        raise ValueError("--k-sweep values must be >= 1")
    config = BenchConfig(
        sets=tuple(args.sets) if args.sets else PROMPT_SETS,
        prompts_per_set=args.prompts_per_set or (1 if quick else None),
        modes=tuple(args.modes) if args.modes else (("greedy",) if quick else ("greedy", "sampled")),
        reps=args.reps or (1 if quick else 3),
        max_new_tokens=args.max_new_tokens or (32 if quick else 128),
    )
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target, tokenizer = load_model(args.target, "target", dtype, device)
    plain_draft, draft_tok = load_model(args.draft, "draft", dtype, device)
    check_compatible(target, tokenizer, plain_draft, draft_tok)
    cheap_draft = HFModel(copy.deepcopy(plain_draft.model), f"{plain_draft.name} (cheap: CPU defaults)")
    make_cheaper(cheap_draft, tokenizer, device, None, None)
    helper = SpeculativeDecoder(target, tokenizer)

    methods = our_methods(target, tokenizer, cheap_draft, plain_draft, k_sweep, helper.eos_ids)
    if not args.no_hf:
        methods += hf_methods(target, plain_draft, helper.eos_ids, tokenizer.pad_token_id)
    sample_ids = helper.encode("def f(x):\n    return x * 2\n" * 4)
    curve = measure_cost_curve(target, sample_ids, max_n=max(12, max(k_sweep) + 2))
    bench = run_benchmark(methods, helper.encode, config, exact_dtype(dtype))
    summary = summarise(bench, curve)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "specdecode " + shlex.join(args.argv),
            "machine": f"{platform.machine()} {platform.system()}, {torch.get_num_threads()} threads, "
                       f"device {device}",
            "target": target.name, "draft": plain_draft.name, "dtype": str(dtype).replace("torch.", ""),
            "max_new_tokens": config.max_new_tokens, "reps": config.reps, "warmup": config.warmup,
            "k_sweep": k_sweep, "cost_curve": curve, "errors": bench["errors"], "divergences": bench["divergences"]}
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1, default=float))
    (out / "results.md").write_text(markdown(summary, meta))
    plot(summary, k_sweep, out / "speedup.png")
    console.print(markdown(summary, meta), markup=False, highlight=False)
    emit_json({"out": str(out), "errors": len(bench["errors"]), "divergences": len(bench["divergences"]),
               "speedup": {s: {m: {name: round(r["speedup"], 3) for name, r in rows.items()}
                               for m, rows in modes.items()} for s, modes in summary.items()}})
    return 1 if bench["errors"] else 0
