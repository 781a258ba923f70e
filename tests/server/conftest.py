"""A real `specdecode serve` process on a free loopback port, with tiny models saved to disk."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from specdecode.server.launch import ServerProcess, free_port
from tests.tiny import save_pair


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("server-models"), seed=41, scale=0.3, noise=0.05, max_len=512)


class Server(ServerProcess):
    def __init__(self, model_dirs, *extra: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "specdecode", "serve", "--target", model_dirs[0], "--draft", model_dirs[1],
               "--dtype", "float32", "--port", str(self.port), "--model-id", "tiny", *extra]
        super().__init__(cmd, f"http://127.0.0.1:{self.port}", output=subprocess.PIPE)

    def stop(self) -> None:
        super().stop(timeout=10)

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
