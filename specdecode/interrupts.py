"""Ctrl-C held back over work that would lose it, and raised once that work is done."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def ctrl_c_after() -> Iterator[None]:
    """Run the block with Ctrl-C held back; if it was pressed meanwhile, raise KeyboardInterrupt as the
    block ends. For work where a KeyboardInterrupt would be lost:

    - the imports (torch and transformers: seconds): libraries swallow it there (a bare `except:`) and
      leave half-imported modules that fail later, a traceback (seen on a loaded 2-core CPU);
    - llama.cpp's loads (weights, contexts): while they run, the only Python code is llama.cpp's log
      callback, so the KeyboardInterrupt was raised in there, where ctypes swallows it (5 of 5 Ctrl-Cs
      during loads went unheard, and `generate` ran on to exit 0).

    Blocking the signal in this thread would not do: another thread (llama.cpp's, torch's) takes it.
    Only the main thread sets signal handlers, and a handler other than Python's default (an ignored
    SIGINT in a background job, a caller's own) is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda number, frame: pressed.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a key pressed from here on raises
    if pressed:
        raise KeyboardInterrupt
