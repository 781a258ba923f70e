"""Shared printing: rich tables for people, one JSON document for machines."""

from __future__ import annotations

import errno
import json
import sys
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.style import Style
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left", min_width=len(title) + 4)
    for col in columns:
        t.add_column(col, justify="right")
    for row in rows:
        t.add_row(*(fmt(v) for v in row))
    return t


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def print_error(message: str) -> None:
    """One line on stderr: `error: <message>` (the message is not markup, and is not wrapped)."""
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    err_console.print(f"[red]error:[/] {escape(one_line)}", soft_wrap=True, highlight=False)


def emit_json(payload: dict[str, Any]) -> None:
    stdout().write(json.dumps(payload, indent=None, default=float) + "\n")


def write_text(text: str, style: str | None = None) -> None:
    """Generated text on stdout exactly as generated: rich's print expands tabs, drops control
    characters such as \\r and turns ":x:" into an emoji. A style (rich's words: "green") colours it
    with ANSI codes when stdout is a terminal that shows colour."""
    if style and console.is_terminal and console.color_system:
        text = Style.parse(style).render(text)
    out = stdout()
    out.write(text)
    out.flush()


def stdout():
    """sys.stdout, or an OSError naming the problem when it was closed (`specdecode ... >&-`)."""
    if sys.stdout is None:
        raise OSError(errno.EBADF, "standard output is closed: give the command somewhere to write")
    return sys.stdout
