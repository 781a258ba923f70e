"""Entry point: `specdecode <command>`. Errors in user input print one clear line, not a traceback."""

from __future__ import annotations

import argparse
import sys

from specdecode import __version__
from specdecode.cli import audit, bench, generate, serve, theory
from specdecode.cli.output import err_console


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdecode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parsers(sub)
    bench.add_parsers(sub)
    audit.add_parsers(sub)
    serve.add_parsers(sub)
    theory.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in reports (e.g. the benchmark's command line)
    try:
        return args.func(args)
    except ValueError as exc:
        err_console.print(f"[red]error:[/] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
