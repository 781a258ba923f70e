"""Command-line interface: thin wrappers that parse, call the library, and print."""

from __future__ import annotations

import importlib
import signal
import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


def main(argv: list[str] | None = None) -> int:
    """`specdecode ...` (cli/main.py), where Ctrl-C is one line and status 130 wherever it lands: in the
    imports (torch takes seconds; held back until they finish), in loading models, or in generating."""
    try:
        run, pressed = holding_ctrl_c(lambda: importlib.import_module("specdecode.cli.main").main)
        if pressed:
            raise KeyboardInterrupt
        return run(argv)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return INTERRUPTED


def holding_ctrl_c(work: Callable[[], T]) -> tuple[T, bool]:
    """`work()` with Ctrl-C held back until it returns, and whether it was pressed. For the imports (torch
    and transformers: seconds): libraries swallow a KeyboardInterrupt there (a bare `except:`) and leave
    half-imported modules that fail later, a traceback (seen on a loaded 2-core CPU). Only the main thread
    sets signal handlers, and an ignored SIGINT (a background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return work(), False
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda number, frame: pressed.append(number))
    try:
        result = work()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a key pressed from here on raises
    return result, bool(pressed)


__all__ = ["main"]
