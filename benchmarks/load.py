"""Load generator: concurrent streaming clients against `specdecode serve` (loopback only, bounded).

For each server configuration (one process at a time, so nothing else competes for the cores)
and each concurrency level, C clients each send R streaming completions back to back and
the run reports aggregate tokens/s (all completion tokens / wall time), per-request latency
(p50/p95) and time to first token (p50/p95). The configurations:

    one-at-a-time   --max-batch 1 (the server before batching), speculation on (auto, adaptive K)
    batched         --max-batch B, speculation on
    batched, plain  --max-batch B, every request with "specdecode": {"speculative": false}

The bound the cost curve allows is printed beside: B one-token rows per pass / T(B tokens),
from the calibration file the server measured (`<cache>/calibration`).

    python benchmarks/load.py --clients 1 2 4 8 --requests 2 --max-tokens 64 --out benchmarks/results/load
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from specdecode.bench.harness import load_prompts


class Server:
    def __init__(self, port: int, *flags: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "specdecode", "serve", "--port", str(port), "--queue-size", "64", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 600  # the first start may calibrate the batch pass sizes
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {flags} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_request(url: str, model: str, prompt: str, max_tokens: int, speculative: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "specdecode": {"speculative": speculative}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("choices") and event["choices"][0].get("text") and first is None:
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"latency": time.perf_counter() - t0, "ttft": first or 0.0, "tokens": tokens}


def load(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
         speculative: bool) -> dict:
    results: list[dict] = []
    errors: list[str] = []

    def client(i: int) -> None:
        for j in range(requests):
            try:
                results.append(one_request(url, model, prompts[(i * requests + j) % len(prompts)], max_tokens,
                                           speculative))
            except Exception as exc:  # noqa: BLE001 - reported
                errors.append(repr(exc))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    wall = time.perf_counter() - t0
    q = lambda xs, f: statistics.quantiles(xs, n=20)[18] if len(xs) >= 2 and f == 95 else statistics.median(xs)  # noqa: E731
    lat, ttft = [r["latency"] for r in results], [r["ttft"] for r in results]
    return {"clients": clients, "requests": len(results), "errors": errors,
            "tokens_per_s": sum(r["tokens"] for r in results) / wall, "wall_s": wall,
            "latency_p50": q(lat, 50), "latency_p95": q(lat, 95), "ttft_p50": q(ttft, 50), "ttft_p95": q(ttft, 95)}


def counters(url: str) -> dict[str, float]:
    """The server's totals that say what K it chose: rows verified, drafts, rounds, batch sizes."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {"specdecode_rounds_total", "specdecode_tokens_drafted_total", "specdecode_tokens_accepted_total",
            "specdecode_batch_size_sum", "specdecode_batch_size_count", "specdecode_pass_tokens_sum",
            "specdecode_prefill_seconds_total", "specdecode_tokens_generated_total"}
    out = dict.fromkeys(want, 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in want:
                out[sample.name] += sample.value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if any(c < 1 or c > 64 for c in args.clients) or not 1 <= args.requests <= 20:
        ap.error("--clients must be 1..64 and --requests 1..20 (a bounded load)")
    prompts = [item["prompt"] for name in ("codegen", "codeedit", "chat") for item in load_prompts(name)]
    configs = [("one-at-a-time", ["--max-batch", "1"], True),
               (f"batched B={args.max_batch}", ["--max-batch", str(args.max_batch)], True),
               (f"batched B={args.max_batch}, plain", ["--max-batch", str(args.max_batch)], False)]
    rows = []
    for name, flags, speculative in configs:
        server = Server(args.port, *flags)
        try:
            model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
            load(server.url, model, prompts, 1, 1, 8, speculative)  # warm-up
            for clients in args.clients:
                before = counters(server.url)
                row = {"config": name, **load(server.url, model, prompts, clients, args.requests, args.max_tokens,
                                              speculative)}
                after = counters(server.url)
                d = {k: after[k] - before[k] for k in after}
                rounds = max(1.0, d["specdecode_batch_size_count"])  # target passes
                # the worker prefills between rounds (nothing else runs then): the rest is decoding
                decode_s = row["wall_s"] - d["specdecode_prefill_seconds_total"]
                row |= {"decode_tokens_per_s": d["specdecode_tokens_generated_total"] / max(decode_s, 1e-9),
                        "prefill_share": d["specdecode_prefill_seconds_total"] / row["wall_s"],
                        "mean_batch": d["specdecode_batch_size_sum"] / rounds,
                        "mean_pass_tokens": d["specdecode_pass_tokens_sum"] / rounds,
                        # rows are request-rounds: K per row = drafts per request-round
                        "mean_k": d["specdecode_tokens_drafted_total"] / max(1.0, d["specdecode_rounds_total"]),
                        "accepted_per_draft": d["specdecode_tokens_accepted_total"]
                        / max(1.0, d["specdecode_tokens_drafted_total"])}
                rows.append(row)
                print(f"{name:28s} clients={clients:2d}  {row['tokens_per_s']:6.1f} tok/s  "
                      f"decode {row['decode_tokens_per_s']:6.1f} tok/s (prefill {row['prefill_share']:.0%})  "
                      f"latency p50 {row['latency_p50']:5.1f}s p95 {row['latency_p95']:5.1f}s  "
                      f"ttft p50 {row['ttft_p50']:5.2f}s p95 {row['ttft_p95']:5.2f}s  batch {row['mean_batch']:4.1f} "
                      f"pass {row['mean_pass_tokens']:5.1f} tok  K/row {row['mean_k']:4.2f}  "
                      f"errors {len(row['errors'])}",
                      flush=True)
        finally:
            server.stop()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
