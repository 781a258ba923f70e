"""`specdecode audit`: check that speculative decoding is lossless for your models and settings."""

from __future__ import annotations

import argparse

from specdecode.cli.audit_server import add_server_args, run_server_audit
from specdecode.cli.generate import add_model_args, int_in, load_decoder, non_negative_int, positive_int, seed_int
from specdecode.cli.output import console, emit_json, table
from specdecode.audit.verdict import EXIT
from specdecode.core import VERIFY_RULES

DEFAULT_PROMPTS = ["Write a Python function that reverses a string.", "def fibonacci(n):"]
NEIGHBOUR_PROMPTS = ["import numpy as np\n\n", "The quick brown fox"]  # --batched: the audited row's neighbours


MAX_SAMPLES = 100_000  # more is days of sampling in-process, and far more requests than a server's audit needs


def sample_count(text: str) -> int:
    """argparse type: --samples, 1 to MAX_SAMPLES."""
    return int_in(text, 1, MAX_SAMPLES, f"an integer from 1 to {MAX_SAMPLES:,}")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="statistical check that the output law is exactly the target's",
                       description="Sample many speculative rounds from fixed prefixes and compare the first "
                                   "one and two emitted tokens with the target's exact distribution "
                                   "(chi-square, TV bound); check greedy identity; run a broken-rule "
                                   "negative control that must be flagged. With --server URL: the same "
                                   "certificate for any OpenAI-compatible endpoint, black box, over HTTP: the law "
                                   "of its answers with speculation on against a reference without it.")
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=None, help="audit prompt (repeatable; default: two)")
    p.add_argument("--chat", action="store_true", help="apply the chat template to the prompts")
    p.add_argument("--k", type=positive_int, default=None, help="fixed K >= 1 (default: adaptive)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature > 0 (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    p.add_argument("--samples", type=sample_count, default=None,
                   help="rounds per law check (default 400; quick 200); with --server, answers per side per group "
                        "(default 300; quick 200)")
    p.add_argument("--greedy-tokens", type=non_negative_int, default=None,
                   help="tokens for greedy identity (default 64; with --server 32, quick 16, 0 = no greedy checks)")
    p.add_argument("--level", type=float, default=1e-3,
                   help="overall false-failure probability of the statistical checks (default %(default)g)")
    p.add_argument("--control", default="always-accept", choices=["always-accept", "residual-from-p"],
                   help="the broken rule used as negative control (default always-accept)")
    p.add_argument("--verify", choices=list(VERIFY_RULES), default="token",
                   help="the verification rule to audit: token (default) or block")
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed, 0 to 2**63 - 1 (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="200 samples, 32 greedy tokens, and one prompt unless --prompt gives them; with --server, "
                        "two prompts at temperature 1 (200 answers a side each) and 16 greedy tokens")
    p.add_argument("--batched", action="store_true",
                   help="run the law checks batched: every pass of the audited sequence also carries two "
                        "neighbour sequences (their own prompts, drafts and randomness), as in the server "
                        "(the audited sequence then drafts K = 3 unless --k is given)")
    p.add_argument("--json", action="store_true", help="print one JSON document (verdict, advice, every check)")
    shared = {"samples", "greedy_tokens", "level", "quick", "json", "help"}
    in_process = [a for a in p._actions if a.dest not in shared]
    server = add_server_args(p)
    p.set_defaults(func=run_audit_cmd, in_process_options=in_process, server_options=server, all_options=p._actions)


def check_mode(args: argparse.Namespace) -> None:
    """A ValueError for an option given that the audit's mode (in-process, or --server) does not read, even
    at its default value (`--temperature 1` with --server would be ignored, and say nothing)."""
    server = args.server is not None
    unused = args.in_process_options if server else args.server_options[1:]
    given = [a for a in given_options(args.all_options, args.argv) if a in unused]
    if not given:
        return
    option = given[0].option_strings[0]
    if not server:
        raise ValueError(f"{option} applies to the audit of a server: give --server URL")
    fix = SERVER_FIXES.get(given[0].dest, "the settings are swept: give them with --setting K=V,...")
    raise ValueError(f"{option} applies to the in-process audit, not to --server ({fix})")


# with --server, where the in-process audit's options have their counterparts
SERVER_FIXES = {"prompt": "give prompts in a JSON file with --prompts FILE", "chat": "give chat prompts as "
                "{\"messages\": [...]} in --prompts FILE", "seed": "a server's answers carry its own randomness"}


def given_options(actions: list[argparse.Action], argv: list[str]) -> list[argparse.Action]:
    """The actions among `actions` (all of a parser's) that the command line names, as argparse reads it:
    `--opt`, `--opt=v`, or a unique prefix of a long option (an exact name wins: `--prompt` is not `--prompts`)."""
    given = []
    for token in argv[: argv.index("--")] if "--" in argv else argv:
        if not token.startswith("-") or token == "-":
            continue
        name = token.split("=", 1)[0]
        exact = [a for a in actions if name in a.option_strings]
        prefix = [a for a in actions if name.startswith("--") and len(name) > 2
                  and any(o.startswith(name) for o in a.option_strings)]
        given += [a for a in (exact or prefix) if a not in given]
    return given


def run_audit_cmd(args: argparse.Namespace) -> int:
    check_mode(args)
    if args.server is not None:
        return run_server_audit(args)
    from specdecode.audit import AuditConfig, run_audit
    from specdecode.core.probs import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    config = AuditConfig(samples=args.samples or (200 if args.quick else 400),
                         greedy_tokens=(32 if args.quick else 64) if args.greedy_tokens is None else args.greedy_tokens,
                         level=args.level,
                         k=args.k, control=args.control, seed=args.seed)
    prompts = args.prompt or (DEFAULT_PROMPTS[:1] if args.quick else DEFAULT_PROMPTS)
    args.max_batch = 1 + len(NEIGHBOUR_PROMPTS) if args.batched else 1
    decoder = load_decoder(args)
    ids = [decoder.encode(p, args.chat) for p in prompts]
    neighbours = [(slot, decoder.encode(p, args.chat)) for slot, p in zip(decoder.slots[1:], NEIGHBOUR_PROMPTS)]
    report = run_audit(decoder.target, decoder.drafters, ids, sampling, config, rule=VERIFY_RULES[args.verify],
                       progress=not args.json, neighbours=neighbours)
    if args.json:
        emit_json(report.to_dict())
        return EXIT[report.verdict]
    rows = [[c.name, _result(c), _p(c.p_value), f"{c.level:.2g}", c.samples,
             f"{c.tv:.3f}", f"{c.tv_bound:.3f}", f"{c.seconds:.1f}"] for c in report.law_checks]
    batched = ", batched beside 2 sequences" if args.batched else ""
    settings = f"temperature {sampling.temperature:g}, top-k {sampling.top_k}, top-p {sampling.top_p:g}"
    console.print(table(f"law checks ({settings}, {args.verify} verification{batched})", ["check", "result", "p-value", "level", "samples", "TV",
                                                     "TV bound", "s"], rows))
    console.print(table("greedy identity", ["check", "result", "tokens", "note", "s"],
                        [[c.name, "PASS" if c.passed else "FAIL", c.tokens, c.note, f"{c.seconds:.1f}"]
                         for c in report.greedy_checks]))
    c = report.control
    verdict = ("[green]detected[/] (the audit has power)" if report.control_detected else
               "[yellow]NOT detected[/]" if c.tested else "[yellow]untested[/] (too few samples for a test)")
    console.print(f"{c.name}: p-value {_p(c.p_value)} at level {c.level:.2g}: {verdict}")
    overall = {"pass": "[green]PASS[/]", "fail": "[red]FAIL[/]",
               "inconclusive": f"[yellow]INCONCLUSIVE[/] (no check failed, but {report.advice})"}
    console.print(f"overall: {overall[report.verdict]}; false-failure "
                  f"probability <= {config.level:g} (Bonferroni over {len(report.law_checks)} tests); "
                  f"{report.seconds:.0f} s")
    return EXIT[report.verdict]


def _result(check) -> str:
    return "FAIL" if not check.passed else "PASS" if check.tested else "untested"


def _p(p_value: float | None) -> str:
    return "none" if p_value is None else f"{p_value:.3g}"  # none: no test (an inconclusive verdict says why)
