"""Entry point: `specdecode <command>`. Errors in user input print one clear line, not a traceback."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from specdecode import __version__
from specdecode.cli import audit, bench, generate, serve, theory
from specdecode.cli.flags import cli_message
from specdecode.cli.output import print_error, stdout


class Parser(argparse.ArgumentParser):
    """Usage errors print one line (what is wrong, where to read more) and exit 2, not the whole usage."""

    def error(self, message: str):
        dashed = [a for a in getattr(self, "argv", ()) if a.startswith("-") and not a.startswith("--")
                  and not _is_number(a)]
        if dashed and "required: prompt" in message:  # argparse took the prompt "-x" for an option
            fix = f"{self.prog} [options] -- {shlex.quote(dashed[0])}"
            message += f"; a prompt that starts with '-' goes after `--`: {fix}"
        print_error(f"{self.prog}: {message} (see `{self.prog} --help`)")
        self.exit(2)

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an argument no option takes is named by the command it was given to (argparse
        reports it from the top, pointing at `specdecode --help` for a `specdecode theory` option)."""
        args = list(sys.argv[1:] if args is None else args)
        for parser in (self, *getattr(self, "commands", {}).values()):
            parser.argv = args  # for error(): a prompt that argparse read as an option
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            commands = getattr(self, "commands", {})  # the subcommands' parsers by name (build_parser)
            commands.get(getattr(parsed, "command", None), self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="specdecode", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdecode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parsers(sub)
    bench.add_parsers(sub)
    audit.add_parsers(sub)
    serve.add_parsers(sub)
    theory.add_parsers(sub)
    parser.commands = dict(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in reports (e.g. the benchmark's command line)
    try:
        if args.command != "serve":  # the others exist to print: say so at once, not after the work (rich
            stdout()                 # printed into a closed stdout without a word)
        return args.func(args)
    except BrokenPipeError:  # the reader left (`specdecode generate ... | head -1`): nothing to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 1
    except ValueError as exc:  # bad input: options, model files, prompts (every layer raises these)
        print_error(cli_message(exc))
        return 2
    except OSError as exc:  # the file system or the network refused: say what, where, and how to fix it
        print_error(describe_os_error(exc))
        return 1


def describe_os_error(exc: OSError) -> str:
    """One line for an OSError, with the fix when it concerns the weights cache."""
    message = f"{exc.strerror or exc}: {exc.filename!r}" if exc.filename else str(exc) or type(exc).__name__
    weights = sys.modules.get("specdecode.backends.weights")  # loaded by whatever touched the cache
    hint = weights.cache_error_hint(exc) if weights is not None else None
    return f"{message}; {hint}" if hint else message


if __name__ == "__main__":
    sys.exit(main())
