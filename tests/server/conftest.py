"""A real `specdecode serve` process on a free loopback port, with tiny models saved to disk."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.tiny import save_pair



@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("server-models"), seed=41, scale=0.3, noise=0.05, max_len=512)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dirs, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specdecode", "serve", "--target", model_dirs[0], "--draft", model_dirs[1],
               "--dtype", "float32", "--port", str(self.port), "--model-id", "tiny", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not start within 60 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of a metric in /metrics (parsed as Prometheus text) that carry `labels`
        (e.g. le="32.0" for one bucket of a histogram)."""
        from prometheus_client.parser import text_string_to_metric_families
        total = 0.0
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total


@pytest.fixture(scope="session")
def server(model_dirs):
    s = Server(model_dirs, "--drafter", "model")
    yield s
    s.stop()
