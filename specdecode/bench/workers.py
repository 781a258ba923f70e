"""One engine per process: benchmark methods that run in a child process, called one at a time.

Thread pools of two engines in one process (llama.cpp's and torch's) slowed each other
2-8x when tried, so each engine family lives in its own process, loaded once. The
parent keeps interleaving methods exactly as before: a remote method's `run` sends
the job to its process and waits (the other processes sit idle in a blocking read),
and the time is measured inside the child around the generation alone.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import traceback
from contextlib import contextmanager
from typing import Callable

from specdecode.bench.methods import Method, RunResult
from specdecode.checks import SettingError
from specdecode.core.probs import SamplingParams

# a module-level function (picklable by name) that loads models and returns (methods, info): info is
# JSON-able facts measured in that process (e.g. the target's cost curve), read by the parent
Builder = Callable[..., tuple[list[Method], dict]]


class MethodWorker:
    """A child process holding the methods `builder(**kwargs)` makes."""

    def __init__(self, builder: Builder, **kwargs) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited thread pools
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, builder, kwargs), daemon=True)
        with _sigint_ignored():  # Ctrl-C is the parent's to handle: the child would print a traceback
            self._proc.start()
        child.close()
        self.specs, self.info = self._recv()  # specs: (name, family, k) of each method

    def methods(self) -> list[Method]:
        def runner(name: str):
            return lambda ids, sampling, seed, max_new: self.call(name, ids, sampling, seed, max_new)
        return [Method(name, family, k, runner(name)) for name, family, k in self.specs]

    def call(self, name: str, ids: list[int], sampling: SamplingParams, seed: int, max_new: int) -> RunResult:
        self._conn.send((name, ids, sampling, seed, max_new))
        return self._recv()

    def _recv(self):
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"benchmark worker exited unexpectedly (code {self._proc.exitcode})") from None
        if kind == "invalid":  # bad input (options, models, a context too small): one line, as in the parent
            raise payload if isinstance(payload, ValueError) else ValueError(payload)
        if kind == "error":
            raise RuntimeError(f"benchmark worker failed:\n{payload}")
        return payload

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()


@contextmanager
def _sigint_ignored():
    """SIGINT ignored while a child starts: an ignored signal stays ignored across exec, and Python
    keeps it so, so the terminal's Ctrl-C (sent to the whole process group) reaches the parent alone,
    which ends and takes its daemon children with it."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _serve(conn, builder: Builder, kwargs: dict) -> None:
    try:
        built, info = builder(**kwargs)
        methods = {m.name: m for m in built}
        conn.send(("ok", ([(m.name, m.family, m.k) for m in built], info)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(_failure(exc))
        return
    while (job := conn.recv()) is not None:
        name, ids, sampling, seed, max_new = job
        try:
            conn.send(("ok", methods[name].run(ids, sampling, seed, max_new)))
        except Exception as exc:  # noqa: BLE001
            conn.send(_failure(exc))


def _failure(exc: Exception) -> tuple[str, object]:
    """A ValueError is bad input, said in one line (every layer raises these for it; a SettingError goes
    whole, for the CLI to name its options); anything else is a defect, sent with its traceback."""
    if isinstance(exc, ValueError):
        return "invalid", exc if isinstance(exc, SettingError) else str(exc)
    return "error", traceback.format_exc()
