"""`specdecode bench`: our methods vs plain decoding vs Hugging Face, measured side by side."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
from pathlib import Path

from specdecode.cli.generate import add_model_args, positive_int
from specdecode.cli.output import console, emit_json
from specdecode.core import VERIFY_RULES

K_SWEEP_MAX = 64  # a pass of K + 1 tokens per round; `theory` takes K up to 64 too


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark speculative decoding against plain decoding and HF",
                       description="Run plain decoding, our speculative methods (K sweep, adaptive, lookup, suffix, "
                                   "auto) and Hugging Face generate (plain, assisted, prompt lookup) interleaved "
                                   "on the prompt sets; write results.json, results.md and speedup.png.")
    add_model_args(p)
    p.add_argument("--quick", action="store_true",
                   help="one prompt per set, greedy, K in {2, 4}, 1 repetition, 32 tokens (a few minutes)")
    p.add_argument("--sets", nargs="+", default=None, help="prompt sets (default: all three, codegen codeedit chat)")
    p.add_argument("--prompts-per-set", type=positive_int, default=None,
                   help="use the first N prompts of each set (default: all; 1 with --quick)")
    p.add_argument("--modes", nargs="+", default=None,
                   help="greedy and/or sampled at temperature 0.7 (default: both; greedy with --quick)")
    p.add_argument("--k-sweep", type=positive_int, nargs="+", default=None,
                   help="fixed K values (default 1..8; 2 4 with --quick)")
    p.add_argument("--reps", type=positive_int, default=None,
                   help="timed repetitions per cell (default 3; 1 with --quick)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help="tokens per generation (default 128; 32 with --quick)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=None,
                   help="include Hugging Face generate() (plain, assisted, prompt lookup); default: on for the "
                        "transformers backend, off for llama.cpp (it needs the float32 conversion)")
    p.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=None,
                   help="include llama.cpp's own plain and prompt-lookup decoding of the same GGUF "
                        "(default: on for GGUF targets on CPU)")
    p.add_argument("--verify", nargs="+", choices=list(VERIFY_RULES), default=["token"],
                   help="verification rules to measure: the first runs every method of ours; each further one "
                        "adds the adaptive methods again, named '<method> (<rule>)' (default: token)")
    p.add_argument("--methods", nargs="+", default=None, metavar="PREFIX",
                   help="run only the methods whose names start with one of these (e.g. auto lookup llama.cpp; "
                        "our plain decoding always runs: it is the baseline; default: every method)")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out/)")
    p.set_defaults(func=run_bench)


def writable_directory(path: str) -> Path:
    """`path` as a directory we can write to, created if needed; OSError (exit 1, one line) otherwise."""
    if not path.strip():  # Path("") is the current directory: the results would land there unasked
        raise ValueError("--out is empty: give the directory for results.json, results.md and speedup.png")
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {path!r} is a file: give a directory for results.json, results.md and speedup.png")
    out.mkdir(parents=True, exist_ok=True)  # PermissionError, ...
    probe = out / ".specdecode-write-test"
    probe.write_text("")  # a read-only directory fails here, as results.json would after the run
    probe.unlink()
    return out


def check_method_prefixes(prefixes: list[str] | None, switched_off: dict[str, str] | None = None) -> None:
    """Refuse a --methods prefix that no method name can start with, or only methods of a family
    this run leaves out (`switched_off`: family -> the flag that brings it in), before any model loads."""
    from specdecode.bench.methods import FAMILIES

    def families(p: str) -> list[str]:
        return [f for f in FAMILIES if f.startswith(p.lower()) or p.lower().startswith(f)]

    bad = [p for p in prefixes or () if not families(p)]
    if bad:
        raise ValueError(f"--methods: no method starts with {', '.join(map(repr, bad))}; method names start with "
                         + ", ".join(f.strip() for f in FAMILIES))
    for p in prefixes or ():
        off = [switched_off[f] for f in families(p) if f in (switched_off or {})]
        if len(off) == len(families(p)):
            raise ValueError(f"--methods {p}: these methods are off in this run; add {' or '.join(off)}")


def check_model_options(args: argparse.Namespace) -> None:
    """Draft options that bench would not read (its methods fix their drafters): refused, not ignored."""
    given = [flag for flag, on in (("--drafter", args.drafter != "auto"), ("--draft-confidence", args.draft_confidence),
                                   ("--draft-int8/--no-draft-int8", args.draft_int8 is not None),
                                   ("--draft-vocab", args.draft_vocab is not None), ("--recalibrate", args.recalibrate))
             if on]
    if given:
        raise ValueError(f"{given[0]} has no effect on bench: each method fixes its drafter and settings (pick "
                         f"methods with --methods); drop it")


def check_extra_methods_selected(methods: list, verify: list[str], tree: int) -> None:
    """--verify RULE and --tree N only add methods (named "... (RULE)", "..., tree N"): a --methods choice
    that keeps none of them would run without the flag's effect, so it is refused."""
    names = [m.name for m in methods]
    for rule in dict.fromkeys(verify):
        if rule != "token" and not any(name.endswith(f"({rule})") for name in names):
            raise ValueError(f"--verify {rule} adds methods named '... ({rule})', and --methods keeps none of them: "
                             f"add one (e.g. --methods 'auto adaptive') or drop --verify {rule}")
    if tree and not any(f"tree {tree}" in name for name in names):
        raise ValueError(f"--tree {tree} adds methods named '..., tree {tree}', and --methods keeps none of them: "
                         f"add one (e.g. --methods 'model adaptive') or drop --tree")


def select_methods(methods: list, prefixes: list[str] | None) -> list:
    """The methods named by `prefixes` (case-insensitive name prefixes), plus the baseline."""
    from specdecode.bench.methods import BASELINE

    if not prefixes:
        return methods
    wanted = [p.lower() for p in prefixes]
    unknown = [p for p in prefixes if not any(m.name.lower().startswith(p.lower()) for m in methods)]
    if unknown:
        raise ValueError(f"--methods: no method starts with {', '.join(map(repr, unknown))}; the methods are: "
                         + ", ".join(m.name for m in methods))
    return [m for m in methods if m.name == BASELINE or any(m.name.lower().startswith(p) for p in wanted)]


def run_bench(args: argparse.Namespace) -> int:
    from specdecode.backends.hf import resolve_device
    from specdecode.backends.weights import GGUF_BACKENDS, is_gguf, resolve_backend
    from specdecode.bench.harness import PROMPT_SETS, BenchConfig, run_benchmark
    from specdecode.bench.methods import build_llamacpp_native, build_ours
    from specdecode.bench.report import markdown, plot, summarise
    from specdecode.bench.workers import MethodWorker
    from specdecode.engine.calibration import CALIBRATION_TEXT
    from specdecode.engine.decoder import SpeculativeDecoder

    check_model_options(args)
    check_method_prefixes(args.methods)
    out = writable_directory(args.out)  # before the models load and hours of measuring, not after
    quick = args.quick
    k_sweep = args.k_sweep or ([2, 4] if quick else list(range(1, 9)))
    bad = [k for k in k_sweep if not 1 <= k <= K_SWEEP_MAX]
    if bad:
        raise ValueError(f"--k-sweep values must be 1 to {K_SWEEP_MAX}, got {bad[0]}")
    config = BenchConfig(
        sets=tuple(args.sets) if args.sets else PROMPT_SETS,
        prompts_per_set=args.prompts_per_set or (1 if quick else None),
        modes=tuple(args.modes) if args.modes else (("greedy",) if quick else ("greedy", "sampled")),
        reps=args.reps or (1 if quick else 3),
        max_new_tokens=args.max_new_tokens or (32 if quick else 128),
    )
    device = resolve_device(args.device)
    backend = resolve_backend(args.backend, args.target, device)
    with_hf = args.hf if args.hf is not None else backend == "transformers"
    with_llama = args.llama_cpp if args.llama_cpp is not None else is_gguf(args.target) and device == "cpu"
    if with_llama and not is_gguf(args.target):
        raise ValueError("--llama-cpp needs a GGUF target (llama.cpp runs GGUF files)")
    if args.target is None or Path(args.target).exists():  # else loading names the missing path, the first fix
        check_method_prefixes(args.methods, {family: flag for family, flag, on in
                                             (("hf ", "--hf", with_hf), ("llama.cpp ", "--llama-cpp", with_llama))
                                             if not on})
    # The parent only tokenises: every engine runs in its own process (their thread pools collide).
    helper = SpeculativeDecoder.load(args.target, drafter="lookup", backend=backend, dtype=args.dtype,
                                     device=device, speculative=False, n_ctx=256 if backend in GGUF_BACKENDS else 0,
                                     progress=True)
    encode = helper.encode
    curve_ids = encode(CALIBRATION_TEXT)
    eos_ids = sorted(helper.eos_ids)
    del helper
    n_ctx = args.n_ctx or 4096
    workers = [MethodWorker(build_ours, target=args.target, draft=args.draft, backend=backend, dtype=args.dtype,
                            device=device, threads=args.threads, n_ctx=n_ctx if backend in GGUF_BACKENDS else 0,
                            k_sweep=k_sweep, with_hf=with_hf, curve_ids=curve_ids,
                            curve_max=max(16, max(k_sweep) + 2), verifications=tuple(dict.fromkeys(args.verify)),
                            trees=(args.tree,) if args.tree else ())]
    if with_llama:
        workers.append(MethodWorker(build_llamacpp_native, target=args.target, threads=args.threads, n_ctx=n_ctx,
                                    eos_ids=eos_ids))
    if with_hf and backend != "transformers":  # HF needs torch weights: its own process
        workers.append(MethodWorker(build_ours, target=args.target, draft=args.draft, backend="transformers",
                                    dtype=args.dtype if args.dtype != "auto" else "auto", device=device, threads=0,
                                    n_ctx=0, k_sweep=[], with_hf=True, curve_ids=curve_ids, curve_max=2))
    try:
        ours = workers[0].info
        methods = [m for w in workers for m in w.methods()
                   if w is workers[0] or m.family != "ours"]  # a second torch process adds only HF's rows
        methods = select_methods(methods, args.methods)
        check_extra_methods_selected(methods, args.verify, args.tree)
        bench = run_benchmark(methods, encode, config, ours["exact"])
    finally:
        for w in workers:
            w.close()
    summary = summarise(bench, ours["cost_curve"])

    meta = {"command": "specdecode " + shlex.join(args.argv),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, device {device}, "
                       f"backend {backend}, threads {args.threads or 'default'}",
            "target": ours["target"], "draft": ours["draft"], "dtype": ours["dtype"],
            "max_new_tokens": config.max_new_tokens, "reps": config.reps, "warmup": config.warmup,
            "k_sweep": k_sweep, "cost_curve": ours["cost_curve"], "errors": bench["errors"],
            "divergences": bench["divergences"]}
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=1, default=float))
    (out / "results.md").write_text(markdown(summary, meta))
    plot(summary, k_sweep, out / "speedup.png")
    console.print(markdown(summary, meta), markup=False, highlight=False)
    emit_json({"out": str(out), "errors": len(bench["errors"]), "divergences": len(bench["divergences"]),
               "speedup": {s: {m: {name: round(r["speedup"], 3) for name, r in rows.items()}
                               for m, rows in modes.items()} for s, modes in summary.items()},
               "vs_fastest_plain": {s: {m: {name: round(r["vs_fastest_plain"], 3) for name, r in rows.items()}
                                        for m, rows in modes.items()} for s, modes in summary.items()}})
    return 1 if bench["errors"] else 0
