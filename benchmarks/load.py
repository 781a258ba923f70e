"""Load generator: concurrent streaming clients against `specdecode serve` (loopback only, bounded).

For each server configuration (one process at a time, so nothing else competes for the cores)
and each concurrency level, C clients each send R streaming completions back to back and
the run reports aggregate tokens/s (all completion tokens / wall time), per-request latency
(p50/p95) and time to first token (p50/p95). The configurations:

    one-at-a-time   --max-batch 1 (the server before batching), speculation on (auto, adaptive K)
    batched         --max-batch B, speculation on
    batched, plain  --max-batch B, every request with "specdecode": {"speculative": false}
    llama-server    with --llama-server PATH: llama.cpp's own server binary on the same target
                    GGUF with B parallel slots (-np B, the same per-slot context, unified KV
                    cache, the same threads), plain decoding, the same requests

Configurations that differ only in that per-request flag share one server process and alternate
at each concurrency level. Every server is up at once and they take turns at each level (order
rotated with --repeat; medians and ratios over llama-server in summary.md), so the machine's drift
does not land on whichever server ran last. The prompts repeat across levels (both servers keep
a prompt cache), and every server is sent each prompt once before anything is timed, so no
configuration pays a prefill the others were spared; --fresh makes every prompt new. The bound the
cost curve allows (B one-token rows per pass / T(B tokens)) comes from the calibration file the
server measured (`<cache>/calibration`; docs/guide.md, "Calibration").

    python benchmarks/load.py --clients 1 2 4 8 --requests 2 --max-tokens 128 \
        --configs one-at-a-time batched plain llama-server --llama-server PATH \
        --out benchmarks/results/load-MACHINE-DATE
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from specdecode.bench.harness import load_prompts
from specdecode.server.launch import ServerProcess


class Server(ServerProcess):
    def __init__(self, port: int, *flags: str, cmd: list[str] | None = None) -> None:
        """`specdecode serve` with `flags`, or the command `cmd` (another server on `port`)."""
        with socket.socket() as probe:  # a server already there would answer the health checks meant for this one
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                raise SystemExit(f"port {port} is in use: stop what listens there or pass --port with a free one")
        cmd = cmd or [sys.executable, "-m", "specdecode", "serve", "--port", str(port), "--queue-size", "64", *flags]
        # the first start may calibrate the batch pass sizes
        super().__init__(cmd, f"http://127.0.0.1:{port}", timeout=600, name=f"the server {shlex.join(cmd)}")


def llama_server_command(binary: Path, port: int, slots: int) -> list[str]:
    """llama.cpp's server on the embedded target GGUF, set up as `specdecode serve --max-batch slots` is:
    per-slot context min(trained, 32768 / slots), one unified KV pool, the same thread count, and on a
    build with AMX the same weight buffers (`--no-repack`: its default load takes the AMX path that
    crashed; backends/llamacpp.py's `amx_build`)."""
    import llama_cpp

    from specdecode.backends.llamacpp import amx_build, default_threads
    from specdecode.backends.weights import TARGET, ensure_gguf

    threads = str(default_threads())
    return [str(binary), "-m", str(ensure_gguf(TARGET)), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(32768 // slots * slots), "--kv-unified", "-t", threads, "-tb", threads,
            "--no-webui", "-ngl", "0", *(["--no-repack"] if amx_build(llama_cpp) else [])]


class FreshPrompts(list):
    """The prompts, each time taken with a first line of its own (a counter), so every request's
    prompt is new to any cache (--fresh: the cost of prompt processing, not of reusing it)."""

    _count = itertools.count()

    def __getitem__(self, i):
        return f"# request {next(self._count)}\n" + super().__getitem__(i)


def one_request(url: str, model: str, prompt: str, max_tokens: int, speculative: bool | None) -> dict:
    """One streaming completion; speculative None: a server that is not ours (no specdecode field)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if speculative is not None:
        body["specdecode"] = {"speculative": speculative}
    t0 = time.perf_counter()
    first = None
    tokens = None
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
    if tokens is None:
        raise RuntimeError("the stream ended without a usage record: its tokens cannot be counted")
    return {"latency": time.perf_counter() - t0, "ttft": first or 0.0, "tokens": tokens}


def load(url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
         speculative: bool | None) -> dict:
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


def prime(url: str, model: str, prompts: list[str], speculative: bool | None) -> None:
    """Send every prompt the run will use once (one new token each), so each server's prompt cache holds
    them all before anything is timed. Without this the configuration that ran first at a level paid the
    prefill of prompts the level met for the first time, and the others, sharing its server, did not:
    speculation on lost 18% at 2 clients in such a turn (15.6 against 19.0 tokens/s in the next)."""
    for prompt in dict.fromkeys(prompts):
        one_request(url, model, prompt, 1, speculative)


def paired(url: str, model: str, prompts: list[str], n: int, max_tokens: int) -> dict:
    """One client, n prompts, each sent twice in a row, with speculation on and off (the order
    swapped from prompt to prompt): the fairest single-request comparison a drifting machine allows."""
    time_of: dict[bool, float] = {True: 0.0, False: 0.0}
    tokens_of: dict[bool, int] = {True: 0, False: 0}
    ratios = []
    for i in range(n):
        rate = {}
        for speculative in ((True, False) if i % 2 == 0 else (False, True)):
            r = one_request(url, model, prompts[i % len(prompts)], max_tokens, speculative)
            time_of[speculative] += r["latency"]
            tokens_of[speculative] += r["tokens"]
            rate[speculative] = r["tokens"] / r["latency"]
        ratios.append(rate[True] / rate[False])
    on, off = tokens_of[True] / time_of[True], tokens_of[False] / time_of[False]
    return {"config": "paired A/B, 1 client", "requests": 2 * n, "on_tokens_per_s": on, "off_tokens_per_s": off,
            "ratio": on / off, "median_prompt_ratio": statistics.median(ratios)}


# the server's totals that say what K it chose: rows verified, drafts, rounds, batch sizes
K_COUNTERS = frozenset({"specdecode_rounds_total", "specdecode_tokens_drafted_total", "specdecode_tokens_accepted_total",
                        "specdecode_batch_size_sum", "specdecode_batch_size_count", "specdecode_pass_tokens_sum",
                        "specdecode_prefill_seconds_total", "specdecode_tokens_generated_total"})


def counters(url: str, want: frozenset[str] = K_COUNTERS) -> dict[str, float]:
    """The server's metric samples named in `want`, each summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out = dict.fromkeys(want, 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in want:
                out[sample.name] += sample.value
    return out


def measure(url: str, model: str, prompts: list[str], name: str, clients: int, args: argparse.Namespace,
            speculative: bool | None, ours: bool) -> dict:
    """One load level against one server, with what our server's counters say about it."""
    before = counters(url) if ours else {}
    row = {"config": name, **load(url, model, prompts, clients, args.requests, args.max_tokens, speculative)}
    if ours:
        after = counters(url)
        d = {k: after[k] - before[k] for k in after}
        rounds = max(1.0, d["specdecode_batch_size_count"])  # target passes
        # prefill: the prompts' share, by tokens, of the passes they ride in; the rest is decoding
        decode_s = row["wall_s"] - d["specdecode_prefill_seconds_total"]
        row |= {"decode_tokens_per_s": d["specdecode_tokens_generated_total"] / max(decode_s, 1e-9),
                "prefill_share": d["specdecode_prefill_seconds_total"] / row["wall_s"],
                "mean_batch": d["specdecode_batch_size_sum"] / rounds,
                "mean_pass_tokens": d["specdecode_pass_tokens_sum"] / rounds,
                # rows are request-rounds: K per row = drafts per request-round
                "mean_k": d["specdecode_tokens_drafted_total"] / max(1.0, d["specdecode_rounds_total"]),
                "accepted_per_draft": d["specdecode_tokens_accepted_total"]
                / max(1.0, d["specdecode_tokens_drafted_total"])}
    detail = f"decode {row['decode_tokens_per_s']:6.1f} tok/s (prefill {row['prefill_share']:.0%})  " if ours else ""
    tail = (f"batch {row['mean_batch']:4.1f} pass {row['mean_pass_tokens']:5.1f} tok  K/row {row['mean_k']:4.2f}  "
            if ours else "")
    print(f"{name:28s} clients={clients:2d}  {row['tokens_per_s']:6.1f} tok/s  {detail}"
          f"latency p50 {row['latency_p50']:5.1f}s p95 {row['latency_p95']:5.1f}s  "
          f"ttft p50 {row['ttft_p50']:5.2f}s p95 {row['ttft_p95']:5.2f}s  {tail}errors {len(row['errors'])}",
          flush=True)
    return row


CONFIGS = ("one-at-a-time", "batched", "plain", "llama-server")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS[:3]),
                    help="server configurations to run, in this order (llama-server needs --llama-server)")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="llama.cpp's llama-server binary (built from the llama.cpp sources that llama-cpp-python "
                         "vendors: cmake -DLLAMA_BUILD_SERVER=ON, target llama-server)")
    ap.add_argument("--paired", type=int, default=0,
                    help="then N prompts from one client, each with speculation on and off in turn, on the batched "
                         "server (needs the configurations batched and plain)")
    ap.add_argument("--fresh", action="store_true",
                    help="give every request's prompt a first line of its own, so no server's prompt cache serves it "
                         "(by default the prompts repeat across levels and repeats, as a shared system prompt would)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="sweep every concurrency level this many times, the servers' order rotated; medians reported")
    ap.add_argument("--port", type=int, default=8765, help="the first server's port (the others take the next ones)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if any(c < 1 or c > 64 for c in args.clients) or not 1 <= args.requests <= 20 or not 0 <= args.paired <= 48 \
            or not 1 <= args.repeat <= 10:
        ap.error("--clients must be 1..64, --requests 1..20, --paired 0..48 and --repeat 1..10 (a bounded load)")
    if "llama-server" in args.configs and (args.llama_server is None or not args.llama_server.is_file()):
        ap.error("the llama-server configuration needs --llama-server PATH to the built binary")
    # the sets in turn (code generation, code editing, chat, code generation, ...): every level's requests mix
    # all three (set after set, the levels of 1-4 clients ran code generation alone, where lookup seldom pays)
    prompts = [item["prompt"] for items in zip(*(load_prompts(name) for name in ("codegen", "codeedit", "chat")))
               for item in items]
    if args.fresh:  # a first line no request shares: no prompt cache can serve any of it
        prompts = FreshPrompts(prompts)
    b = str(args.max_batch)
    known = {"one-at-a-time": ("one-at-a-time", ["--max-batch", "1"], True, False),
             "batched": (f"batched B={b}", ["--max-batch", b], True, False),
             "plain": (f"batched B={b}, plain", ["--max-batch", b], False, False),
             "llama-server": (f"llama-server -np {b}", [], None, True)}
    # configurations that differ only in the per-request flag share one server process and
    # alternate at each concurrency level, so a drift of the machine's speed between server
    # runs does not masquerade as the difference between speculation on and off
    sessions: dict[tuple, list[tuple[str, bool | None]]] = {}
    for name, flags, speculative, foreign in (known[c] for c in args.configs):
        sessions.setdefault((tuple(flags), foreign), []).append((name, speculative))
    # Every server is up at once (an idle one waits on a condition, using no CPU) and the servers take
    # turns at each concurrency level, their order rotated from repeat to repeat: the machine's speed
    # drifts by 10-20% over minutes, which would otherwise land wholly on whichever server ran later.
    servers: list[tuple[Server, str, bool, list[tuple[str, bool | None]]]] = []
    rows = []
    try:
        for i, ((flags, foreign), variants) in enumerate(sessions.items()):
            port = args.port + i
            cmd = llama_server_command(args.llama_server, port, args.max_batch) if foreign else None
            server = Server(port, *flags, cmd=cmd)
            servers.append((server, httpx.get(server.url + "/v1/models").json()["data"][0]["id"], not foreign,
                            variants))
        for server, model, _, variants in servers:
            load(server.url, model, prompts, 1, 1, 8, variants[0][1])  # warm-up
            if not args.fresh:
                prime(server.url, model, prompts[:max(args.clients) * args.requests], variants[0][1])
        for repeat in range(args.repeat):
            for clients in args.clients:
                turn = repeat % len(servers)
                for server, model, ours, variants in servers[turn:] + servers[:turn]:
                    # variants sharing a server take turns too, in a rotating order
                    for name, speculative in variants[repeat % len(variants):] + variants[:repeat % len(variants)]:
                        rows.append(measure(server.url, model, prompts, name, clients, args, speculative, ours)
                                    | {"repeat": repeat})
        for server, model, _, variants in servers:
            if args.paired and {True, False} <= {speculative for _, speculative in variants}:
                rows.append(paired(server.url, model, prompts, args.paired, args.max_tokens))
                print(f"paired A/B, 1 client, {args.paired} prompts: speculation on {rows[-1]['on_tokens_per_s']:.1f} "
                      f"tok/s, off {rows[-1]['off_tokens_per_s']:.1f} tok/s: {rows[-1]['ratio']:.3f}x (median per "
                      f"prompt {rows[-1]['median_prompt_ratio']:.3f}x)", flush=True)
    finally:
        for server, *_ in servers:
            server.stop()
    table = summary(rows, args.clients)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load.json").write_text(json.dumps(rows, indent=2))
        (args.out / "summary.md").write_text(table + "\n")


def summary(rows: list[dict], levels: list[int]) -> str:
    """Median aggregate tokens/s per configuration and concurrency over the repeats, as a markdown table,
    with each configuration's ratio over llama-server's (measured in the same turns) where it ran."""
    runs = [r for r in rows if "clients" in r]
    names = list(dict.fromkeys(r["config"] for r in runs))
    median = {(n, c): statistics.median([r["tokens_per_s"] for r in runs if r["config"] == n and r["clients"] == c])
              for n in names for c in levels}
    reference = next((n for n in names if n.startswith("llama-server")), None)
    lines = ["| configuration | " + " | ".join(f"{c} client{'s' * (c > 1)}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for n in names:
        cells = []
        for c in levels:
            cell = f"{median[n, c]:.1f}"
            if reference and n != reference:
                cell += f" ({median[n, c] / median[reference, c]:.2f}x)"
            cells.append(cell)
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    note = f"tokens/s, median of {max(r.get('repeat', 0) for r in runs) + 1} repeat(s)"
    return "\n".join(lines) + f"\n\n{note}" + (f"; (ratio over {reference})" if reference else "")


if __name__ == "__main__":
    main()
