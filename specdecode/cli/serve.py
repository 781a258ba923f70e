"""`specdecode serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import socket

from specdecode.cli.generate import (add_model_args, batch_size, load_decoder, non_negative_int, port_number,
                                     positive_int, seconds)
from specdecode.cli.output import err_console
from specdecode.engine.calibration import CALIBRATION_TEXT
from specdecode.engine.config import DEFAULT_PREFILL_TOKENS


def model_name(text: str) -> str:
    """argparse type: `--model-id`, the name clients send: not empty, no surrounding spaces."""
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError(f"must be a non-empty name without surrounding spaces, got {text!r}")
    return text


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                       description="POST /v1/completions and /v1/chat/completions (streaming with stream=true), "
                                   "GET /v1/models, /health and /metrics (Prometheus). A request may carry "
                                   '"specdecode": {"k": N, "speculative": false, "verification": "token"|"block", '
                                   '"reproducible": true} to pin K, disable speculation, choose the exact '
                                   "verification rule or ask for reproducible sampling, for itself.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port (default 8000)")
    p.add_argument("--queue-size", type=positive_int, default=16,
                   help="requests allowed to wait for a slot, then 429 (default 16)")
    p.add_argument("--max-batch", type=batch_size, default=0,
                   help="requests decoded at once, continuous batching: one target pass per round for all "
                        "(default 0 = auto: 4 on the GGUF backends, native and llama.cpp, 1 on transformers; on "
                        "llama.cpp each sequence's context is then --n-ctx, or 32768 tokens shared out)")
    p.add_argument("--prompt-cache-mb", type=non_negative_int, default=1024,
                   help="host memory for copies of finished requests' prompt and output K/V, restored when a later "
                        "prompt starts the same way (a shared system prompt, a chat's earlier turns) instead of "
                        "computed again (default 1024 MiB, about 36k tokens of the embedded target; 0 = off)")
    p.add_argument("--prefill-chunk", type=positive_int, default=DEFAULT_PREFILL_TOKENS,
                   help="prompt tokens computed per round, beside the running requests' tokens: a long prompt runs "
                        "in pieces this size, so the streams already running pause for one piece at a time "
                        f"(default {DEFAULT_PREFILL_TOKENS}; smaller: steadier streams, a later first token for "
                        "long prompts)")
    p.add_argument("--model-id", type=model_name, default=None, help="the model name clients send (default: the target's)")
    p.add_argument("--max-body-bytes", type=positive_int, default=4 * 2 ** 20,
                   help="largest request body in bytes, then 413 (default 4194304 = 4 MiB)")
    p.add_argument("--drain-seconds", type=seconds, default=10,
                   help="on SIGTERM/SIGINT, how long queued and running requests may finish before they end "
                        "with a 503 (default 10; a second signal ends them at once)")
    p.add_argument("--keep-alive-seconds", type=positive_int, default=5,
                   help="close a connection idle this long, one that has not sent a complete request head "
                        "within it, or one whose request body stalls that long (default 5)")
    p.set_defaults(func=run_serve)


def check_can_listen(host: str, port: int) -> None:
    """Bind the address once before the models load (seconds to minutes), so a port in use or a host
    that does not resolve is one line at once, not a traceback after loading."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve it ({exc.strerror}); give an address such as 127.0.0.1") \
            from None
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as exc:
        raise ValueError(f"cannot listen on {host} port {port}: {exc.strerror}; choose another --port or --host") \
            from None


def run_serve(args: argparse.Namespace) -> int:
    from specdecode.server.app import create_app
    from specdecode.server.process import serve

    check_can_listen(args.host, args.port)
    decoder = load_decoder(args)
    # Adaptive K's costs, from the calibration cache or measured now (about a minute on a 2-core CPU the
    # first time): before serving. Measured at the first request instead, they held it and every request
    # queued behind it for minutes while /health answered ok.
    with err_console.status("adaptive K: measuring this machine's pass and draft costs (once; then cached)"):
        decoder.calibrate(decoder.encode(CALIBRATION_TEXT))
    model_id = args.model_id or decoder.target.name.split(":")[-1]
    app = create_app(decoder, model_id, max_queue=args.queue_size, max_body_bytes=args.max_body_bytes,
                     prompt_cache_bytes=args.prompt_cache_mb * 2 ** 20, prefill_tokens=args.prefill_chunk)
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address in a URL
    err_console.print(f"serving {model_id!r} on http://{host}:{args.port}/v1")
    serve(app, args.host, args.port, drain_seconds=args.drain_seconds, keep_alive_seconds=args.keep_alive_seconds)
    return 0
