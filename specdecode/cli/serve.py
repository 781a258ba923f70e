"""`specdecode serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse

from specdecode.cli.generate import add_model_args, load_decoder
from specdecode.cli.output import err_console


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                       description="POST /v1/completions and /v1/chat/completions (streaming with stream=true), "
                                   "GET /v1/models, /health and /metrics (Prometheus). A request may carry "
                                   '"specdecode": {"k": N, "speculative": false} to change K or disable '
                                   "speculation for itself.")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--queue-size", type=int, default=16, help="requests allowed to wait (then 429)")
    p.add_argument("--model-id", default=None, help="the model name clients send (default: the target's)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from specdecode.server.app import create_app

    decoder = load_decoder(args)
    model_id = args.model_id or decoder.target.name.split(":")[-1]
    app = create_app(decoder, model_id, max_queue=args.queue_size)
    err_console.print(f"serving {model_id!r} on http://{args.host}:{args.port}/v1")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
