"""`--help` is the reference for every option: each option that takes a value states its default there."""

import argparse
import importlib

import pytest

# Flags take no value: off unless given, which their help need not repeat.
FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
         argparse._CountAction, argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def renderings(value) -> set[str]:
    """How a help text may write a default value (an int as 128 or 128,000, a float as 0.001 or 1e-03)."""
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, (int, float)):
        return {str(value), format(value, "g"), f"{value:,}"}
    if isinstance(value, str):
        return {value} if value else set()
    return set()  # lists and other values: the help says "default" and what it is in words


def undocumented_defaults(parser: argparse.ArgumentParser) -> list[str]:
    """The options of `parser` whose help (as --help prints it) does not state the default: the word
    "default" missing, or, for a number or a string, the value itself missing."""
    formatter = parser._get_formatter()
    problems = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, FLAGS):
            continue
        name = "/".join(action.option_strings)
        text = formatter._expand_help(action) if action.help else ""
        if "default" not in text.lower():
            problems.append(f"{name}: no default in its help {text!r}")
        elif (values := renderings(action.default)) and not any(v in text for v in values):
            problems.append(f"{name}: its help does not say the default {action.default!r}: {text!r}")
    return problems


COMMANDS = ["audit", "bench", "generate", "rand7", "serve", "simulate", "theory"]


def parsers() -> dict[str, argparse.ArgumentParser]:
    """`specdecode`'s parser and its commands'. Imported when a test runs, not when it is collected: importing
    the module specdecode.cli.main binds that name in the package, over the function `main` that other test
    modules import from it."""
    parser = importlib.import_module("specdecode.cli.main").build_parser()
    return {"specdecode": parser, **parser.commands}


def test_every_command_is_checked():
    assert sorted(parsers()) == sorted(["specdecode", *COMMANDS])  # a new command joins COMMANDS


@pytest.mark.parametrize("command", ["specdecode", *COMMANDS])
def test_help_states_every_default(command):
    assert undocumented_defaults(parsers()[command]) == []


def test_control_an_unstated_or_wrong_default_is_caught():
    parser = argparse.ArgumentParser()
    parser.add_argument("--silent", type=int, default=3, help="how many")
    parser.add_argument("--wrong", type=int, default=3, help="how many (default 4)")
    parser.add_argument("--none", default=None, help="a path")
    parser.add_argument("--fine", type=float, default=1e-3, help="a level (default %(default)g)")
    parser.add_argument("--flag", action="store_true", help="a switch")
    problems = undocumented_defaults(parser)
    assert [p.split(":")[0] for p in problems] == ["--silent", "--wrong", "--none"]
