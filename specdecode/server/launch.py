"""A server run as a child process on a loopback port, ready once it answers: how the tests and the
benchmarks start our server (and llama.cpp's, to measure against), and how a script of yours can."""

from __future__ import annotations

import socket
import subprocess
import time
from typing import IO

import httpx


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`cmd` started as a child process serving `url`; the constructor returns once GET url + `ready`
    answers 200, and raises RuntimeError (the server stopped) if the child exits first or `timeout`
    seconds pass. `output`: where its stdout and stderr go (a file, DEVNULL, or PIPE, whose text the
    error quotes)."""

    def __init__(self, cmd: list[str], url: str, *, ready: str = "/health", timeout: float = 60.0,
                 output: int | IO = subprocess.DEVNULL, name: str = "the server") -> None:
        self.cmd, self.url, self.name = cmd, url, name
        self.proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, text=output == subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = f": {self.proc.stdout.read()}" if self.proc.stdout is not None else ""
                raise RuntimeError(f"{name} exited with {self.proc.returncode} before answering{said}")
            try:
                if httpx.get(url + ready, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} did not answer GET {ready} within {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (our server drains its requests), then SIGKILL after `timeout` seconds."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
