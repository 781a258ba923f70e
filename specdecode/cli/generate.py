"""`specdecode generate "prompt"`: stream text from the target, sped up by the drafter."""

from __future__ import annotations

import argparse
import time

from specdecode.cli.flags import cli_setting
from specdecode.cli.output import console, emit_json, err_console, table, write_text
from specdecode.backends.llamacpp import MAX_THREADS
from specdecode.core import VERIFY_RULES
from specdecode.core.probs import SamplingParams
from specdecode.engine.config import DRAFTER_CHOICES, GenerationConfig, check_seed
from specdecode.engine.stats import GenerationStats

MAX_BATCH = 256  # --max-batch: llama.cpp's limit on the sequences of one context (LLAMA_MAX_SEQ)

STYLE = {"draft": "green", "alternative": "magenta", "correction": "yellow", "bonus": "bold cyan", "target": ""}


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a usage error, exit 2, otherwise)."""
    return int_in(text, 0, None, "an integer >= 0")


def thread_count(text: str) -> int:
    """argparse type: llama.cpp threads, 0 (the machine's cores) to llama.cpp's limit (more aborted it)."""
    return int_in(text, 0, MAX_THREADS, f"an integer from 0 to {MAX_THREADS} (0 = the machine's cores)")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return int_in(text, 1, None, "an integer >= 1")


def seed_int(text: str) -> int:
    """argparse type: a sampling seed (the config's check, `check_seed`)."""
    try:
        value: object = int(text)
    except ValueError:
        value = text  # not a number: the check names the range
    try:
        return check_seed(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fraction_below_one(text: str) -> float:
    """argparse type: a number in [0, 1) (`--draft-confidence`)."""
    return _float_where(text, lambda x: 0.0 <= x < 1.0, "a number in [0, 1)")


def positive_finite(text: str) -> float:
    """argparse type: a finite number > 0 (`theory --c`)."""
    return _float_where(text, lambda x: 0.0 < x < float("inf"), "a finite number > 0")


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0 (`serve --drain-seconds`)."""
    return _float_where(text, lambda x: 0.0 <= x < float("inf"), "a finite number of seconds >= 0")


def _float_where(text: str, ok, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not ok(value):  # NaN fails every comparison, so every check
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def batch_size(text: str) -> int:
    """argparse type: `--max-batch`, 0 (auto) to MAX_BATCH."""
    return int_in(text, 0, MAX_BATCH, f"an integer from 0 (auto) to {MAX_BATCH}")


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1-65535 (`serve --port`)."""
    return int_in(text, 1, 65535, "a port number from 1 to 65535")


def int_in(text: str, low: int, high: int | None, what: str) -> int:
    """argparse type's core: an integer from `low` to `high` (None: no bound), else a usage error saying `what`."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model-selection flags shared by every command that loads models."""
    p.add_argument("--target", help="target: transformers model directory or .gguf file "
                                    "(default: embedded Qwen2.5-Coder-1.5B-Instruct)")
    p.add_argument("--draft", help="draft: directory or .gguf (default: embedded Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "llama.cpp", "transformers"],
                   help="auto (default): native (our own kernels) for GGUF files (the embedded pair) on CPU, "
                        "llama.cpp where the CPU lacks AVX2, transformers for model directories and on CUDA")
    p.add_argument("--threads", type=thread_count, default=0,
                   help="native / llama.cpp threads (default 0 = the machine's cores)")
    p.add_argument("--n-ctx", type=non_negative_int, default=0,
                   help="native / llama.cpp context size in tokens, up to the model's trained context (default 0 = the "
                        "model's, at most 32768 shared by the batch's sequences)")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure adaptive K's costs anew (they are cached per machine, model and backend)")
    p.add_argument("--dtype", default="auto",
                   help="transformers backend: auto (default: bfloat16), float32, bfloat16, float16, float64")
    p.add_argument("--device", default="auto", help="auto (default: CUDA if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--drafter", default="auto", choices=list(DRAFTER_CHOICES),
                   help="auto: prompt lookup when it finds a match, else the draft model (default); "
                        "model: draft model only; lookup: prompt lookup only (no draft model loaded); "
                        "suffix: the latest continuation in the prompt and output, else in earlier requests, "
                        "drafted as far as the counts make it likely (no draft model loaded; the server "
                        "keeps its history across requests)")
    p.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=None,
                   help="transformers backend: int8 weights for the draft (default: on for CPU, off on CUDA; "
                        "exactness is unaffected)")
    p.add_argument("--draft-vocab", type=non_negative_int, default=None,
                   help="transformers backend: restrict the draft's output head to the N most frequent tokens "
                        "(default: 32768 on CPU, 0 = the full vocabulary on CUDA)")
    p.add_argument("--draft-confidence", type=fraction_below_one, default=0.0,
                   help="end a draft early when the draft's top probability is below this (default 0 = off)")
    p.add_argument("--tree", type=non_negative_int, default=0,
                   help="draft trees: up to N extra candidates per round where the draft is unsure (with "
                        "auto, also prompt lookup's continuations of the draft's paths; with suffix, its other "
                        "continuations), verified exactly in the same pass (adaptive K keeps those that pay); "
                        "drafter model, auto or suffix; default 0 = chains")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--k", type=int, default=None,
                   help="draft tokens per round (default: adaptive, from the measured costs and alpha)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob (default 0)")
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed, 0 to 2**63 - 1 (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    p.add_argument("--verify", choices=list(VERIFY_RULES), default="token",
                   help="the exact verification rule: token (token by token, default) or block (the draft "
                        "judged as a whole, Sun et al. 2025: never fewer tokens per round; same output law). "
                        "Block verification is a chain rule: with --tree, tree rounds use the multi-candidate rule")
    p.add_argument("--reproducible", action="store_true",
                   help="reproducible sampling: each token a function of (seed, position), drafts accepted only "
                        "when equal to it, so the output equals --no-spec with the same seed whatever K or "
                        "drafter (same law; fewer drafts accepted than the default rule; on llama.cpp, within "
                        "its kernels' rounding, which can flip a near-tie between a pass and a step)")


def config_from_args(args: argparse.Namespace) -> GenerationConfig:
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, k=args.k, seed=args.seed,
                            stop=tuple(args.stop), verification=args.verify, reproducible=args.reproducible)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding",
                       description="Stream a completion from the target model, drafted by the draft model. "
                                   "Greedy unless --temperature is set; the output is exactly the target's.")
    p.add_argument("prompt", help="the prompt text")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--no-spec", action="store_true", help="plain autoregressive decoding (the baseline)")
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding afterwards and report the measured speedup")
    p.add_argument("--show-drafts", action="store_true",
                   help="colour tokens: green = accepted draft, magenta = accepted tree alternative (a branch beside "
                        "the chain), yellow = correction, cyan = bonus")
    p.add_argument("--json", action="store_true", help="print one JSON document (text + statistics)")
    p.set_defaults(func=run_generate)


def load_decoder(args: argparse.Namespace, speculative: bool = True):
    from specdecode.engine.decoder import SpeculativeDecoder

    from specdecode.backends.cpu import default_threads

    cores = default_threads()
    if args.threads > cores:  # allowed (a container may see fewer cores than it gets), but rarely meant
        err_console.print(f"[yellow]note:[/] --threads {args.threads} is more than the {cores} cores this process "
                          f"may use: the passes will wait on each other (0 = one thread a core)", highlight=False)

    return SpeculativeDecoder.load(args.target, args.draft, drafter=args.drafter, backend=args.backend,
                                   threads=args.threads, n_ctx=args.n_ctx, recalibrate=args.recalibrate,
                                   dtype=args.dtype,
                                   device=args.device, draft_int8=args.draft_int8, draft_vocab=args.draft_vocab,
                                   draft_confidence=args.draft_confidence, speculative=speculative,
                                   tree=args.tree,
                                   max_batch=getattr(args, "max_batch", 1),
                                   progress=not getattr(args, "json", False))


def run_generate(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.temperature == 0:  # greedy decoding reads no sampling option: refuse them rather than ignore them
        sampling_only = [flag for flag, given in (("--top-p", args.top_p != 1.0), ("--top-k", args.top_k != 0),
                                                  ("--min-p", args.min_p != 0.0), ("--reproducible", args.reproducible))
                         if given]
        if sampling_only:
            raise ValueError(f"{sampling_only[0]} only applies when sampling, and --temperature 0 (the default) is "
                             f"greedy: add --temperature > 0, or drop {sampling_only[0]}")
    speculative = not args.no_spec
    if not speculative:  # options that only speculation reads: refuse them rather than ignore them
        unused = [flag for flag, given in (("--compare", args.compare), ("--k", args.k is not None),
                                           ("--show-drafts", args.show_drafts), ("--tree", args.tree > 0),
                                           ("--verify block", args.verify != "token"),
                                           (f"--drafter {args.drafter}", args.drafter != "auto"),
                                           ("--draft", args.draft is not None),
                                           ("--draft-confidence", args.draft_confidence > 0),
                                           ("--draft-int8/--no-draft-int8", args.draft_int8 is not None),
                                           ("--draft-vocab", args.draft_vocab is not None),
                                           ("--recalibrate", args.recalibrate))
                  if given]
        if unused:
            raise ValueError(f"{unused[0]} has no effect with --no-spec (plain decoding drafts nothing): "
                             f"drop one of the two")
    if args.json and args.show_drafts:
        raise ValueError("--show-drafts colours the printed text, which --json does not print (its stats.k_per_round "
                         "and accepted counts say the same): drop one of the two")
    decoder = load_decoder(args, speculative=speculative or args.compare)
    stats = GenerationStats()
    t0 = time.perf_counter()
    pieces: list[str] = []
    tokens: list[int] = []
    for chunk in decoder.stream(args.prompt, config, chat=args.chat, speculative=speculative, stats=stats):
        pieces.append(chunk.text)
        if args.json:
            continue
        if args.show_drafts:
            _print_coloured(decoder, tokens, chunk)
        else:
            write_text(chunk.text)
        tokens += chunk.tokens
    wall = time.perf_counter() - t0
    text = "".join(pieces)
    context_full = stats.finish_reason == "length" and stats.new_tokens < config.max_new_tokens

    baseline = None
    if args.compare and speculative:
        baseline = decoder.generate(args.prompt, config, chat=args.chat, speculative=False)

    if args.json:
        payload = {"text": text, "speculative": speculative, "wall_seconds": wall, "stats": stats.summary(),
                   "context_full": context_full}
        if baseline is not None:
            payload["baseline"] = {"stats": baseline.stats.summary(), "same_text": baseline.text == text,
                                   "speedup": _ratio(stats, baseline.stats)}
        emit_json(payload)
        return 0
    console.print()
    if context_full:  # finish "length" alone would read as --max-new-tokens reached
        setting = decoder.target.context_setting
        err_console.print(f"[yellow]note:[/] stopped after {stats.new_tokens} of --max-new-tokens "
                          f"{config.max_new_tokens} tokens: the model's context of {decoder.target.max_length} "
                          f"tokens is full" + (f" (raise {cli_setting(setting, None)})" if setting else ""),
                          highlight=False, soft_wrap=True)
    _print_stats(stats, speculative)
    if baseline is not None:
        same = "identical" if baseline.text == text else "different (expected only when sampling, or in bf16)"
        console.print(f"plain decoding: {baseline.stats.tokens_per_second:.2f} tok/s; speculative "
                      f"{stats.tokens_per_second:.2f} tok/s: [bold]{_ratio(stats, baseline.stats):.2f}x[/]; "
                      f"outputs {same}")
    return 0


def _ratio(spec: GenerationStats, base: GenerationStats) -> float:
    return spec.tokens_per_second / base.tokens_per_second if base.tokens_per_second else float("nan")


def _print_coloured(decoder, before: list[int], chunk) -> None:
    """Print the chunk's text, each token's share in the colour of its source. The text printed is
    the chunk's own, so it ends where a stop string cut it (the last token's text may run past it)."""
    prefix = decoder.tokenizer.decode(before, skip_special_tokens=True)
    ids, left = list(before), chunk.text
    for tok, src in zip(chunk.tokens, chunk.sources):
        ids.append(tok)
        text = decoder.tokenizer.decode(ids, skip_special_tokens=True)
        n, prefix = len(text) - len(prefix), text
        piece, left = left[:n], left[n:]
        write_text(piece, STYLE[src] or None)
    write_text(left)  # empty unless the decoded pieces fall short of the chunk's text


def _print_stats(stats: GenerationStats, speculative: bool) -> None:
    rows = [["new tokens", stats.new_tokens], ["tokens/s (decode)", stats.tokens_per_second],
            ["prefill s", stats.t_prefill], ["finish", stats.finish_reason]]
    if speculative:
        per_pos = " ".join(f"{a}/{r}" for a, r in zip(stats.accepted_per_position, stats.reached_per_position))
        rows += [["rounds", stats.num_rounds], ["drafted / accepted", f"{stats.drafted} / {stats.accepted}"],
                 ["accepted/tested per position", per_pos or "-"],
                 ["mean acceptance length (incl. bonus)", stats.mean_acceptance_length],
                 ["K per round (mean)", f"{stats.mean_k:.2f}"],
                 ["drafter rounds", _drafter_counts(stats)],
                 ["tree rounds / mean nodes / won by an alternative",
                  f"{len(stats.tree_rounds)} / {stats.mean_tree_nodes:.1f} / {stats.off_chain_rounds}"],
                 ["alpha (per-position estimate)", _opt(stats.alpha)],
                 ["time draft / verify s", f"{stats.t_draft:.2f} / {stats.t_verify:.2f}"],
                 ["c = T_verify / T_draft step", _opt(stats.c)],
                 ["predicted speedup E[N]c/(c+K)", _opt(stats.predicted_speedup)]]
    err_console.print(table("statistics", ["", "value"], rows))


def _drafter_counts(stats: GenerationStats) -> str:
    names = stats.drafter_per_round
    return " ".join(f"{n}:{names.count(n)}" for n in sorted(set(names)))


def _opt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
