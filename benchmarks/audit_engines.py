"""`specdecode audit --server` against real engines on this machine, and their verdicts kept.

Each case starts its servers on free loopback ports (the embedded GGUF pair), runs the audit as a
user would (`python -m specdecode audit --server URL ... --json`), stops the servers and writes the
audit's JSON and a summary. The cases:

    ours          `specdecode serve` (speculation on, K pinned per request to 2) against the same server
                  with `{"specdecode": {"speculative": false}}` per request (the audit finds both bodies)
    llama-draft   llama.cpp's llama-server with the draft model (-md, --spec-type draft-simple, 3 drafts) against a
                  second llama-server on the same target without speculation
    llama-ngram   llama-server with n-gram speculation (--spec-type ngram-simple, a 4-gram drafting 8 tokens: its
                  defaults, 12 and 48, draft nothing before the context holds 61 tokens) against that plain one
    lcp-lookup    llama-cpp-python's server with its prompt-lookup decoding (--draft_model, 10 tokens)
                  against its server without

llama-server is built from the llama.cpp sources llama-cpp-python vendors (as benchmarks/load.py says):

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp
    cd /tmp/lcp && tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    cmake --build build --target llama-server -j2

llama-cpp-python's server: `pip install 'llama-cpp-python[server]==0.3.36'`. Then, for example:

    python benchmarks/audit_engines.py --llama-server PATH --cases ours llama-draft llama-ngram lcp-lookup \
        --out benchmarks/results/audit-engines-MACHINE-DATE -- --quick

Everything after `--` goes to every audit (`--quick`, `--samples 600`, `--setting temperature=0.7`).
A plain server and a speculative one run at once (one core each where there are two), so the audit's
interleaved requests meet the same machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from specdecode.server.launch import ServerProcess, free_port

CASES = ("ours", "llama-draft", "llama-ngram", "lcp-lookup")


class Server(ServerProcess):
    """A server process, up once GET /v1/models answers; its log goes to `log`."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path) -> None:
        self.log = log.open("w")
        try:  # our server calibrates adaptive K once per machine (minutes)
            super().__init__(cmd, f"http://127.0.0.1:{port}", ready="/v1/models", timeout=900, output=self.log,
                             name=f"{name} (its log: {log})")
        except RuntimeError:
            self.log.close()
            raise

    def stop(self) -> None:
        super().stop()
        self.log.close()


def llama_server(binary: Path, target: Path, port: int, threads: int, *spec: str) -> list[str]:
    return [str(binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-np", "2", "-c", "4096",
            "-t", str(threads), "-tb", str(threads), "-ngl", "0", "--no-webui", "--metrics", *spec]


def lcp_server(target: Path, port: int, threads: int, *spec: str) -> list[str]:
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(target), "--model_alias", "target",
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--chat_format", "chatml",
            # its prompt cache in RAM: without it each request evaluates its prompt anew (about 2 s here),
            # since the audit's requests alternate between prompts
            "--cache", "True", *spec]


def servers_for(case: str, args, logs: Path) -> tuple[list[tuple[str, list[str], int]], list[str]]:
    """(name, command, port) of the servers a case runs, and its audit's own options."""
    from specdecode.backends.weights import DRAFT, TARGET, ensure_gguf

    target, draft = ensure_gguf(TARGET), ensure_gguf(DRAFT)
    on, off = free_port(), free_port()
    if case == "ours":
        return [("specdecode serve", [sys.executable, "-m", "specdecode", "serve", "--port", str(on)], on)], \
            ["--server", f"http://127.0.0.1:{on}"]
    audit = ["--server", f"http://127.0.0.1:{on}", "--reference", f"http://127.0.0.1:{off}", "--concurrency", "2"]
    if case in ("llama-draft", "llama-ngram"):
        if args.llama_server is None:
            raise SystemExit(f"the {case} case needs --llama-server PATH (see this script's docstring)")
        # --spec-type: with -md alone this build loads the draft model and never drafts (its /slots say
        # "speculative": false, its /metrics count no drafts)
        spec = ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", "3", "-ngld", "0"] \
            if case == "llama-draft" else \
            ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4", "--spec-ngram-simple-size-m", "8"]
        return [("llama-server, speculative", llama_server(args.llama_server, target, on, 1, *spec), on),
                ("llama-server, plain", llama_server(args.llama_server, target, off, 1), off)], audit
    if case == "lcp-lookup":
        import importlib.util

        if importlib.util.find_spec("sse_starlette") is None:  # else its server dies at import, log only
            raise SystemExit("the lcp-lookup case needs llama-cpp-python's server: "
                             "pip install 'llama-cpp-python[server]==0.3.36'")
        return [("llama-cpp-python server, prompt lookup",
                 lcp_server(target, on, 1, "--draft_model", "prompt-lookup-decoding",
                            "--draft_model_num_pred_tokens", "10"), on),
                ("llama-cpp-python server, plain", lcp_server(target, off, 1), off)], audit
    raise SystemExit(f"unknown case {case!r}: choose from {', '.join(CASES)}")


def run_case(case: str, args, extra: list[str], out: Path, logs: Path, tag: str) -> dict:
    specs, audit = servers_for(case, args, logs)
    started: list[Server] = []
    try:
        for name, cmd, port in specs:
            started.append(Server(name, cmd, port, logs / f"{case}-{tag}-{len(started)}.log"))
        command = [sys.executable, "-m", "specdecode", "audit", *audit, *extra, "--json"]
        t0 = time.time()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds = time.time() - t0
    finally:
        for server in started:
            server.stop()
    name = f"{case}-{tag}" if tag else case
    record = {"case": name, "servers": [{"name": n, "command": shlex.join(c)} for n, c, _ in specs],
              "audit": shlex.join(["specdecode", "audit", *audit, *extra, "--json"]), "exit": done.returncode,
              "seconds": seconds}
    lines = done.stdout.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        record["report"] = json.loads(lines[-1])
    else:
        record["error"] = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def summary(records: list[dict], machine: str) -> str:
    rows = ["| case | verdict (exit) | tests | detectable TV | control | failed tests | greedy | drafts (endpoint) | s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        d = r.get("report")
        if d is None:
            rows.append(f"| {r['case']} | error ({r['exit']}): {r['error']} | | | | | | | {r['seconds']:.0f} |")
            continue
        failed = "; ".join(f"{c['name']} (p {c['p_value']:.2g}, TV {c['tv']:.3f})" for c in d["comparisons"]
                           if not c["passed"]) or "none"
        control = min((c["p_value"] for c in d["controls"] if c["p_value"] is not None), default=None)
        greedy = ", ".join(g["result"] for g in d["greedy"]) or "none"
        drafts = d["drafts"].get("endpoint")
        drafted = f"{drafts['drafted']} ({drafts['accepted']} accepted, {drafts['source']})" if drafts else "not reported"
        tv = f"{d['detectable_tv']:.3f}" if d["detectable_tv"] else ""
        seen = "detected" if d["control_detected"] else "NOT detected"
        rows.append(f"| {r['case']} | {d['verdict']} ({r['exit']}) | {d['tests']} | {tv} | {seen} (p {control:.2g}) | "
                    f"{failed} | {greedy} | {drafted} | {d['seconds']:.0f} |")
    commands = "\n".join(f"- {r['case']}: " + "; ".join(f"`{s['command']}`" for s in r["servers"]) +
                         f"; then `{r['audit']}`" for r in records)
    return (f"# specdecode audit --server against engines ({machine}, {date.today()})\n\n" + "\n".join(rows) +
            f"\n\nCommands (ports free on loopback, chosen per run):\n\n{commands}\n")


def machine_name() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{model}, {' '.join(simd) or 'no AVX2'}"


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--out", type=Path, required=True, help="where the JSON and summary.md go")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/audit-engines-logs"), help="the servers' logs")
    ap.add_argument("--tag", default="", help="kept in the result's name (CASE-TAG.json): quick, full, confirm...")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.logs.mkdir(parents=True, exist_ok=True)
    records = []
    for case in args.cases:
        print(f"{case}: ...", flush=True)
        records.append(run_case(case, args, extra, args.out, args.logs, args.tag))
        r = records[-1]
        print(f"{case}: {r.get('report', {}).get('verdict', r.get('error'))} (exit {r['exit']}, {r['seconds']:.0f} s)",
              flush=True)
    previous = sorted(args.out.glob("*.json"))
    all_records = [json.loads(p.read_text()) for p in previous]
    (args.out / "summary.md").write_text(summary(all_records, machine_name()))


if __name__ == "__main__":
    main()
