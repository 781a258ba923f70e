"""The CLI's one mapping from the library's parameters to its options (cli/flags.py).

Library errors name parameters (`n_ctx`, `drafter='lookup'`: checks.SettingError); the CLI prints
them as options (`--n-ctx`, `--drafter lookup`). Every parameter a library error names must have an
option, and every option the mapping gives must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import specdecode
from specdecode.checks import SettingError
from specdecode.cli.flags import FLAGS, VALUE_FLAGS, cli_message, cli_setting

PACKAGE = Path(specdecode.__file__).parent
PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)(=[^{}]*)?(\}|$)")


def named_settings() -> dict[str, set[str | None]]:
    """Every parameter (and value) a SettingError in the package names, from its source."""
    named: dict[str, set[str | None]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "SettingError":
                for name, value, _ in PLACEHOLDER.findall(_template(node.args[0])):
                    named.setdefault(name, set()).add(value[1:] if value and "\0" not in value else None)
    return named


def _template(node: ast.expr) -> str:
    """A template's text as written, with "\0" for each value an f-string fills in."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "\0" for part in node.values)
    if isinstance(node, ast.BinOp):  # "..." + (f"..." if x else "")
        return _template(node.left) + _template(node.right)
    return "\0"


def test_the_library_names_settings_the_cli_can_name():
    named = named_settings()
    assert {"n_ctx", "drafter", "backend", "draft", "tree"} <= set(named)  # the scan finds what it looks for
    for name, values in named.items():
        assert name in FLAGS or any((name, v) in VALUE_FLAGS for v in values), name


def test_every_option_of_the_mapping_exists():
    # imported here: importing the submodule at collection would shadow `specdecode.cli.main`, the
    # entry point the other CLI tests import, with the module of that name
    from specdecode.cli.main import build_parser

    options = {opt for parser in [build_parser(), *build_parser().commands.values()]
               for action in parser._actions for opt in action.option_strings}
    for flag in [*FLAGS.values(), *VALUE_FLAGS.values()]:
        assert flag in options, flag


def test_an_error_names_parameters_in_the_library_and_options_in_the_cli():
    error = SettingError("{draft} is a draft model, which {drafter=lookup} does not use; raise {n_ctx}, "
                         "or give {speculative=False}")
    assert str(error) == ("draft is a draft model, which drafter='lookup' does not use; raise n_ctx, "
                          "or give speculative=False")
    assert cli_message(error) == ("--draft is a draft model, which --drafter lookup does not use; raise --n-ctx, "
                                  "or give --no-spec")
    assert cli_message(ValueError("plain {text}")) == "plain {text}"  # not a SettingError: as it is
    with pytest.raises(KeyError):
        cli_setting("no_such_parameter", None)  # a parameter the mapping lacks fails loudly, in the tests above
