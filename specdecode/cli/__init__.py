"""Command-line interface: thin wrappers that parse, call the library, and print."""

from __future__ import annotations

import sys

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


def main(argv: list[str] | None = None) -> int:
    """`specdecode ...` (cli/main.py), where Ctrl-C is one line and status 130 wherever it lands: in the
    imports (torch takes seconds), in loading models, or in generating."""
    try:
        from specdecode.cli.main import main as run

        return run(argv)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return INTERRUPTED


__all__ = ["main"]
