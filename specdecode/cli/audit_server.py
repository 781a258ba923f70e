"""`specdecode audit --server URL`: the black-box audit of an OpenAI-compatible endpoint, over HTTP."""

from __future__ import annotations

import argparse
import json
import os

from specdecode.cli.generate import positive_int, positive_finite
from specdecode.cli.output import console, emit_json, print_error, table

QUICK_SAMPLES, FULL_SAMPLES = 200, 300
MIN_SAMPLES = 20  # answers a side per group: the chi-square approximation's least
QUICK_GREEDY, FULL_GREEDY = 16, 32
QUICK_BOUNDARY, FULL_BOUNDARY = 0, 16
# A temperature x1.25 moves the embedded pair's first-three-token laws by a TV of about 0.1 to 0.15, which 200
# answers a side see only about half the time: the quick run's control is coarser, the full run's the finer.
QUICK_CONTROL, FULL_CONTROL = 1.5, 1.25
AUDIT_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                "top_k", "min_p", "stop", "logprobs", "top_logprobs", "n", "stream", "seed"}


def json_object(text: str) -> dict:
    """argparse type: --body and --reference-body, a JSON object whose fields the audit does not set itself."""
    from specdecode.audit.remote.plan import strict_json

    try:
        value = strict_json(text)
    except ValueError as exc:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {shown!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"specdecode\": {{\"speculative\": "
                                         f"false}}}}', got {text!r}")
    clash = sorted(AUDIT_FIELDS & set(value))
    if clash:
        raise argparse.ArgumentTypeError(f"sets {', '.join(clash)}, which the audit sweeps or sets itself (give "
                                         f"sampling settings with --setting)")
    return value


def level_fraction(text: str) -> float:
    value = positive_finite(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def add_server_args(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options of the black-box audit; returns them (they mean nothing without --server)."""
    from specdecode.audit.remote.plan import parse_setting

    def setting(text: str):
        try:
            return parse_setting(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    g = p.add_argument_group("black-box audit of an OpenAI-compatible server (--server)")
    return [
        g.add_argument("--server", metavar="URL", help="audit this endpoint over HTTP (http://host:port or .../v1) "
                                                       "instead of models in-process (default: none, the in-process audit)"),
        g.add_argument("--reference", metavar="URL", help="the reference without speculation (default: --server, "
                                                          "with --reference-body turning speculation off)"),
        g.add_argument("--body", type=json_object, default=None, metavar="JSON",
                       help="fields merged into every request to the endpoint (default: none; on our server "
                            "'{\"specdecode\": {\"k\": 2}}', so that short answers are drafted)"),
        g.add_argument("--reference-body", type=json_object, default=None, metavar="JSON",
                       help="fields merged into every request to the reference (default with one URL, on our "
                            "server: '{\"specdecode\": {\"speculative\": false}}')"),
        g.add_argument("--model", help="the model to ask for (default: the first of GET /v1/models)"),
        g.add_argument("--reference-model", help="the reference's model, if it serves it by another name "
                                                  "(default: --model's)"),
        g.add_argument("--api-key", default=None, help="bearer key sent to both (default: $OPENAI_API_KEY)"),
        g.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight at once (default 4)"),
        g.add_argument("--timeout", type=positive_finite, default=120.0, help="seconds for one answer (default 120)"),
        g.add_argument("--retries", type=positive_int, default=6,
                       help="tries of a request that met a 429/503 (after its Retry-After), a dropped connection "
                            "or a timeout (default 6)"),
        g.add_argument("--prompts", metavar="FILE", help="a JSON list of prompts: strings (completions) or "
                                                         "objects with \"prompt\" or \"messages\", and \"stop\" (default: the built-in set)"),
        g.add_argument("--setting", type=setting, action="append", default=None, metavar="K=V,...",
                       help="a sampling setting to audit, e.g. temperature=0.7,top_p=0.9 (repeatable; keys "
                            "temperature, top_p, top_k, min_p; default: a sweep of five, quick two)"),
        g.add_argument("--max-tokens", type=positive_int, nargs="+", default=[3], metavar="N",
                       help="max_tokens of the short groups: the law of the first N tokens (default 3)"),
        g.add_argument("--boundary-tokens", type=int, default=None, metavar="N",
                       help=f"max_tokens of the stop/length boundary groups (default {FULL_BOUNDARY}, quick "
                            f"{QUICK_BOUNDARY}; 0 = none)"),
        g.add_argument("--control-factor", type=positive_finite, default=None,
                       help=f"the negative control's temperature factor (default {FULL_CONTROL}, quick {QUICK_CONTROL})"),
        g.add_argument("--tie-margin", type=positive_finite, default=0.25,
                       help="a greedy divergence within this many nats of the top logprob is numerics (default 0.25)"),
        g.add_argument("--top-logprobs", type=int, default=20, metavar="N",
                       help="alternatives asked per token where both servers give logprobs (default 20; 0 = never "
                            "ask, for an engine that speculates less when asked for them)"),
    ]


def check_options(args: argparse.Namespace) -> None:
    """A ValueError naming the option for a value the audit cannot use (argparse's types check the rest)."""
    if args.boundary_tokens is not None and args.boundary_tokens < 0:
        raise ValueError(f"--boundary-tokens must be >= 0, got {args.boundary_tokens}")
    if args.top_logprobs < 0:
        raise ValueError(f"--top-logprobs must be >= 0, got {args.top_logprobs}")
    if args.samples is not None and args.samples < MIN_SAMPLES:
        raise ValueError(f"--samples must be >= {MIN_SAMPLES} with --server (answers a side per group, for the "
                         f"chi-square approximation), got {args.samples}")
    if not 0 < args.level < 0.9:
        raise ValueError(f"--level must be in (0, 0.9), below the 90% power of the detectable-TV figures, got "
                         f"{args.level:g}")
    if args.control_factor == 1:
        raise ValueError("--control-factor must not be 1: the control is the reference at another temperature")
    twice = sorted({n for n in args.max_tokens if args.max_tokens.count(n) > 1})
    if twice:
        raise ValueError(f"--max-tokens gives {twice[0]} twice: each value is a group of its own, give it once")
    settings = args.setting or []
    if len(set(settings)) < len(settings):
        raise ValueError("--setting gives the same setting twice: each is audited once, give it once")
    for option, value in (("--model", args.model), ("--reference-model", args.reference_model)):
        if value is not None and not value.strip():
            raise ValueError(f"{option} is empty: give a model the server lists at /v1/models, or leave {option} "
                             f"out for the first one")


def api_key(given: str | None) -> str | None:
    """The bearer key: --api-key, else $OPENAI_API_KEY, else none; one that no HTTP header can carry is an error
    here, not a traceback at the first request."""
    if given is not None and not given:
        raise ValueError("--api-key is empty: give the key, or leave --api-key out to use $OPENAI_API_KEY")
    key, where = (given, "--api-key") if given is not None else (os.environ.get("OPENAI_API_KEY") or None,
                                                                 "$OPENAI_API_KEY")
    if key is not None and not all(33 <= ord(c) < 127 for c in key):
        raise ValueError(f"{where} holds a character an HTTP header cannot carry (a space, a line break or a "
                         f"non-ASCII letter): give the key exactly as issued")
    return key


def run_server_audit(args: argparse.Namespace) -> int:
    from specdecode.audit.remote import EndpointError, RemoteConfig, Side, run_remote_audit
    from specdecode.audit.remote.client import base_url
    from specdecode.audit.remote.plan import (DEFAULT_PROMPTS, DEFAULT_SETTINGS, QUICK_PROMPTS, QUICK_SETTINGS,
                                              load_prompts)
    from specdecode.audit.verdict import EXIT, NOT_RUN
    from specdecode.cli import INTERRUPTED

    check_options(args)
    url = base_url(args.server, "--server")
    reference_url = base_url(args.reference, "--reference") if args.reference is not None else url
    key = api_key(args.api_key)
    reference_body = args.reference_body
    if reference_body is None and reference_url != url:
        reference_body = {}  # None: the audit finds it (our server's switch), or says what to give
    if reference_url == url and reference_body is not None and reference_body == (args.body or {}):
        raise ValueError("the endpoint and the reference get the same requests at the same URL, which audits nothing: "
                         "give --reference URL (a deployment without speculation) or --reference-body JSON "
                         "(the fields that turn speculation off)")
    prompts = load_prompts(args.prompts) if args.prompts else QUICK_PROMPTS if args.quick else DEFAULT_PROMPTS
    settings = tuple(args.setting) if args.setting else QUICK_SETTINGS if args.quick else DEFAULT_SETTINGS
    config = RemoteConfig(
        samples=args.samples or (QUICK_SAMPLES if args.quick else FULL_SAMPLES), level=args.level,
        concurrency=args.concurrency, timeout=args.timeout, retries=args.retries,
        greedy_tokens=args.greedy_tokens if args.greedy_tokens is not None else
        (QUICK_GREEDY if args.quick else FULL_GREEDY),
        max_tokens=tuple(args.max_tokens),
        boundary_tokens=args.boundary_tokens if args.boundary_tokens is not None else
        (QUICK_BOUNDARY if args.quick else FULL_BOUNDARY),
        control_factor=args.control_factor or (QUICK_CONTROL if args.quick else FULL_CONTROL),
        tie_margin=args.tie_margin, top_logprobs=args.top_logprobs)
    endpoint = Side("endpoint", url, args.body, key, args.model)
    reference = Side("reference", reference_url, reference_body, key, args.reference_model or args.model)
    try:
        report = run_remote_audit(endpoint, reference, prompts, settings, config, progress=not args.json)
    except EndpointError as exc:
        print_error(str(exc))
        return NOT_RUN
    if args.json:
        emit_json(report.to_dict())
    else:
        print_report(report)
    return INTERRUPTED if report.interrupted else EXIT[report.verdict]


def print_report(report) -> None:
    e, r = report.endpoint, report.reference
    console.print(f"endpoint  {e['url']} (model {e['model']}{_body(e['body'])})")
    console.print(f"reference {r['url']} (model {r['model']}{_body(r['body'])})")
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}")
    columns = ["group", "test", "result", "p-value", "answers", "TV", "detectable TV"]
    level = report.comparisons[0].level if report.comparisons else report.level
    console.print(table(f"endpoint vs reference: each test at level {level:.2g}; detectable TV: {report.power:.0%} "
                        f"power, over the test's cells", columns, [_row(c) for c in report.comparisons]))
    if report.controls:
        state = "[green]detected[/] (the run has power)" if report.control_detected else "[yellow]NOT detected[/]"
        console.print(table(f"negative control, which must reject: {state}", columns,
                            [_row(c) for c in report.controls]))
    if report.greedy:
        console.print(table("greedy identity", ["prompt", "result", "at", "margin", "endpoint", "reference"],
                            [[g.name, g.result if g.passed else g.result.upper(), _at(g),
                              "" if g.margin is None else f"{g.margin:.3g}", repr(g.endpoint), repr(g.reference)]
                             for g in report.greedy]))
        for g in report.greedy:
            if g.result != "identical":
                console.print(f"{g.name}: {g.note}", highlight=False)
    for side, d in report.drafts.items():
        rate = f", {d['accepted'] / d['drafted']:.0%} accepted" if d["drafted"] else ""
        console.print(f"{side}: {d['drafted']} drafts in {d['answers']} answers{rate} (its {d['source']})")
    gain = _one_sample_gain(report)
    if gain:
        console.print(gain)
    if report.interrupted:
        console.print(f"[yellow]interrupted[/] after {report.sent} of {report.planned} requests: the tests above are on "
                      f"what had arrived; overall: [yellow]INCONCLUSIVE[/] (rerun it whole)")
        return
    overall = {"pass": "[green]PASS[/]", "fail": "[red]FAIL[/]",
               "inconclusive": f"[yellow]INCONCLUSIVE[/] (no check failed, but {report.advice})"}
    detect = f"; every test detects a TV of {report.detectable_tv:.3f}" if report.detectable_tv else ""
    console.print(f"overall: {overall[report.verdict]}; false-failure probability <= {report.level:g} (Bonferroni over "
                  f"{report.tests} tests and greedy checks){detect}; {report.sent} requests ({report.retried} "
                  f"retried), {report.seconds:.0f} s")


def _row(c) -> list:
    result = "FAIL" if not c.passed else "PASS" if c.tested else "not run"
    return [c.group, c.statistic + (f" ({c.note})" if c.note else ""), result,
            "" if c.p_value is None else f"{c.p_value:.3g}",
            f"{c.samples[0]}/{c.samples[1]}" if c.samples[1] else str(c.samples[0]),
            "" if c.tv is None else f"{c.tv:.3f}", "" if c.detectable_tv is None else f"{c.detectable_tv:.3f}"]


def _at(g) -> str:
    return "" if g.position is None else f"{g.unit} {g.position}"


def _body(body: dict) -> str:
    return f", body {json.dumps(body)}" if body else ""


def _one_sample_gain(report) -> str | None:
    """How much the tests against the reference's logprobs add: their detectable TV beside the two-sample
    tests' of the same first tokens."""
    first = {c.group: c.detectable_tv for c in report.comparisons if c.statistic == "first 1 token"}
    pairs = [(c.detectable_tv, first[c.group]) for c in report.comparisons
             if c.test == "logprobs" and c.detectable_tv and first.get(c.group)]
    if not pairs:
        return None
    one, two = (sum(x) / len(pairs) for x in zip(*pairs))
    return (f"first token: against the reference's logprobs the tests detect a TV of {one:.3f} (mean), the "
            f"two-sample ones {two:.3f}: a law known exactly has the power of twice the answers on each side")
