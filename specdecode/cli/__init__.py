"""Command-line interface: thin wrappers that parse, call the library, and print."""

from __future__ import annotations

import importlib
import sys

from specdecode.interrupts import ctrl_c_after

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


def main(argv: list[str] | None = None) -> int:
    """`specdecode ...` (cli/main.py), where Ctrl-C is one line and status 130 wherever it lands: in the
    imports (torch takes seconds; held back until they finish), in loading models, or in generating."""
    try:
        with ctrl_c_after():
            run = importlib.import_module("specdecode.cli.main").main
        return run(argv)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return INTERRUPTED


__all__ = ["main"]
