"""The server under hostile load on the real pair: many streaming clients, some hanging up mid-stream.

The test suite runs this load against tiny models (`tests/server/test_server.py::
test_continuous_batching_load`); this script runs it against `specdecode serve` with the embedded
pair (loopback only, bounded): C clients each send R greedy streaming completions back to back,
and every seventh request is closed after its first chunk. It fails (exit 1) on any error, a client
still waiting, or a sequence still running or queued after the load, and reports the batch the
server ran, the cancellations it counted and how many distinct outputs each prompt got (on
llama.cpp a row's sums depend on where its cells lie in the batch, so a near-tie can go either way).

    python benchmarks/hangups.py --clients 32 --requests 5 --max-tokens 24 --max-batch 8
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter

import httpx
import openai

from load import Server, counters  # benchmarks/ is on the path when run as a script

PROMPTS = ("def fib(n):", "Write a haiku about rust.", "class Stack:\n    def push(self, x):",
           "Explain TCP slow start in one sentence.", "import numpy as np\n# normalise the rows of a matrix\n")
METRICS = frozenset({"specdecode_running_generations", "specdecode_queued_requests", "specdecode_cancelled_total",
                     "specdecode_batch_size_sum", "specdecode_batch_size_count"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=5, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--port", type=int, default=8977)
    args = ap.parse_args()
    if not 1 <= args.clients <= 64 or not 1 <= args.requests <= 20 or not 1 <= args.max_tokens <= 512 \
            or not 1 <= args.max_batch <= 64:
        ap.error("--clients must be 1..64, --requests 1..20, --max-tokens 1..512 and --max-batch 1..64 (a bounded load)")
    server = Server(args.port, "--max-batch", str(args.max_batch))  # its queue (64) holds every client waiting
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    errors: list[str] = []
    answers: list[tuple[str, str]] = []  # (prompt, text) of every request that ran to its end

    def client(i: int) -> None:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        for j in range(args.requests):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            try:
                stream = api.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                temperature=0, stream=True)
                if (i + j) % 7 == 0:  # this request hangs up after its first chunk
                    next(iter(stream))
                    stream.close()
                    continue
                answers.append((prompt, "".join(c.choices[0].text for c in stream)))
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                errors.append(f"client {i} request {j}: {exc!r}")

    try:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1800)
        wall = time.perf_counter() - t0
        deadline = time.time() + 30  # a hung-up sequence leaves at the end of its round
        while time.time() < deadline and counters(server.url, METRICS)["specdecode_running_generations"] > 0:
            time.sleep(0.2)
        waiting = sum(t.is_alive() for t in threads)
        m = counters(server.url, METRICS)
        running, queued = m["specdecode_running_generations"], m["specdecode_queued_requests"]
        batch = m["specdecode_batch_size_sum"] / max(1.0, m["specdecode_batch_size_count"])
        print(f"{args.clients} clients x {args.requests} requests in {wall:.1f} s: {len(errors)} errors, "
              f"{waiting} clients still waiting, {running:.0f} running and {queued:.0f} queued after, "
              f"{m['specdecode_cancelled_total']:.0f} cancelled, mean batch {batch:.1f}")
        for prompt in PROMPTS:
            texts = Counter(text for asked, text in answers if asked == prompt)
            print(f"  {prompt[:32]!r}: {sum(texts.values())} answers, {len(texts)} distinct")
        for error in errors[:5]:
            print("  " + error)
    finally:
        server.stop()
    sys.exit(1 if errors or waiting or running or queued else 0)


if __name__ == "__main__":
    main()
