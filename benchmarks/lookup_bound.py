"""How fast prompt lookup could ever be on this machine: an oracle bound from the measured cost curve.

For greedy decoding the target's output is fixed, so for every round we know in hindsight how
many of the lookup drafter's proposed tokens the target would accept (a). An oracle that drafts
exactly those a tokens (K = a, or a plain step when a = 0) emits a + 1 tokens for one pass of
a + 1 tokens: in every round a longer draft would only add cost, a shorter one forgo tokens the
pass would have given almost for free. (It is greedy round by round: a policy that stopped short
could land on a position where lookup matches longer, so this is a practical bound, not a
theorem.) Its speedup over plain decoding, sum of tokens * T(1) / sum of T(K + 1), decode only
(the prefill is the same for all), bounds what adaptive K can reach with prompt lookup on this
target, backend and machine.

    python benchmarks/lookup_bound.py --prompts-per-set 8 --out benchmarks/results/lookup-bound-MACHINE-DATE

Beside the bound it replays adaptive K itself on the same outputs (`policy_replay`: the engine's
loop, lookup drafter and policy, against a target that answers with the recorded greedy output,
each pass priced by the measured curve), so the gap between what the policy reaches and what any
policy could is measured without timing noise. `--save-outputs FILE` keeps the greedy outputs and
the curve; `--replay FILE` reruns the analysis from them without loading a model (seconds).

It also reports the acceptance of lookup's drafts by the length of the match they continue
(a long match is copying: its drafts are accepted far more often).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

from specdecode.backends.protocol import Model
from specdecode.bench.harness import PROMPT_SETS, load_prompts
from specdecode.drafters.lookup import LookupConfig, LookupDrafter, NgramIndex
from specdecode.engine.config import GenerationConfig
from specdecode.engine.engine import generate_tokens
from specdecode.engine.policy import AdaptiveK
from specdecode.engine.stats import GenerationStats

MATCH_BUCKETS = ((2, 3), (4, 7), (8, 15), (16, 10**9))


def replay(prompt: list[int], output: list[int], curve: dict[int, float], k_max: int) -> dict:
    """Walk the greedy output as the oracle would; return its time, plain time and acceptance by match."""
    index = NgramIndex(LookupConfig(max_proposal=k_max))
    index.extend(prompt)
    i, t_oracle, by_bucket = 0, 0.0, defaultdict(lambda: [0, 0])
    while i < len(output):
        proposal = index.propose(min(k_max, len(output) - i - 1))
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == output[i + accepted]:
            accepted += 1
        if proposal:
            length = index.match_length(64)  # how far the tail agrees with what lookup copies from
            bucket = next(b for b in MATCH_BUCKETS if b[0] <= length <= b[1])
            by_bucket[bucket][0] += accepted
            by_bucket[bucket][1] += min(accepted + 1, len(proposal))  # positions tested
        t_oracle += min(curve[m] for m in range(accepted + 1, k_max + 2))  # padding to a cheaper size allowed
        index.extend(output[i: i + accepted + 1])
        i += accepted + 1
    return {"t_oracle": t_oracle, "t_plain": len(output) * curve[1], "by_bucket": by_bucket}


class ReplayTarget(Model):
    """A target model whose greedy choice after position i is script[i + 1], whatever was fed: a
    recorded greedy output replayed. A draft is judged against the recorded token at its position,
    which is what the real target chose there whenever every earlier draft was accepted (the only
    case in which verification reads that position)."""

    name = "replay"

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.vocab_size = max(script) + 1
        self.max_length = len(script) + 64  # room for a last round's drafts past the script's end
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def forward(self, tokens, n_logits: int = 1) -> torch.Tensor:
        self._length += len(tokens)
        logits = torch.full((n_logits, self.vocab_size), -1e9)
        for row, position in enumerate(range(self._length - n_logits, self._length)):
            logits[row, self.script[min(position + 1, len(self.script) - 1)]] = 0.0
        return logits

    def truncate(self, length: int) -> None:
        self._length = length

    def sibling(self) -> "ReplayTarget":
        raise NotImplementedError("a replay is one sequence")


def policy_replay(prompt: list[int], output: list[int], costs: dict, policy: AdaptiveK | None = None) -> dict:
    """Adaptive K with prompt lookup on a recorded greedy output: the engine's own loop, drafter and
    policy (calibrated costs `costs`, as `AdaptiveK.costs()` gives them), each round priced by the
    curve: the time of its pass plus lookup's drafting. Returns that time and the rounds' K."""
    policy = policy if policy is not None else AdaptiveK()
    policy.load_costs(costs)
    stats = GenerationStats()
    target = ReplayTarget(prompt + output)
    emitted = [t for rnd in generate_tokens(target, [LookupDrafter()], prompt,
                                            GenerationConfig(max_new_tokens=len(output)), frozenset(), stats,
                                            policy) for t in rnd.tokens]
    if emitted != output:
        raise AssertionError("the replay left the recorded output: the replay target is broken")
    curve, t_look = policy.t_verify, policy.t_step.get("lookup", 0.0)
    seconds = sum(curve[r.verified] + r.drafted * t_look for r in stats.rounds)
    return {"t_policy": seconds, "ks": [r.drafted for r in stats.rounds]}


def record(sets: list[str], prompts_per_set: int, max_new_tokens: int) -> dict:
    """Greedy outputs of the embedded target, and its cost curve and lookup's step cost (calibrated)."""
    from specdecode.engine.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder.load(drafter="lookup", progress=False)
    first = load_prompts(sets[0])[0]
    decoder.calibrate(decoder.encode(first["prompt"], chat=first["chat"]))  # the cached curve, or measure it
    runs = []
    for name in sets:
        for item in load_prompts(name)[:prompts_per_set]:
            ids = decoder.encode(item["prompt"], chat=item["chat"])
            output = decoder.generate_ids(ids, GenerationConfig(max_new_tokens=max_new_tokens), speculative=False)
            runs.append({"set": name, "id": item["id"], "prompt": ids, "output": output})
            print(f"{name}/{item['id']}: {len(output)} tokens", flush=True)
    return {"costs": decoder.policy.costs(), "k_max": decoder.policy.k_max, "runs": runs}


def load_recording(path: Path, sets: list[str], per_set: int, fail) -> dict:
    """A file written by --save-outputs, its runs cut to `sets` and the first `per_set` prompts of
    each (`fail(message)` for a file that is missing or not such a recording)."""
    problem = "not a recording written by --save-outputs"
    try:
        recorded = json.loads(path.read_text())
        if isinstance(recorded.get("costs", {}).get("t_verify"), dict) and isinstance(recorded.get("k_max"), int) \
                and all({"set", "id", "prompt", "output"} <= r.keys() for r in recorded.get("runs", [])):
            problem = None
    except (OSError, ValueError) as e:  # missing, unreadable, not JSON
        problem = str(e)
    except AttributeError:  # JSON, but not objects where the recording has them
        pass
    if problem:
        fail(f"--replay {path}: {problem}")
    taken, runs = Counter(), []
    for run in recorded["runs"]:
        if run["set"] in sets and taken[run["set"]] < per_set:
            taken[run["set"]] += 1
            runs.append(run)
    if not runs:
        fail(f"--replay {path} has no runs of the sets {', '.join(sets)}")
    return {**recorded, "runs": runs}


def analyse(recorded: dict, curve: dict[int, float]) -> tuple[dict, dict]:
    """Per set: the oracle's and adaptive K's speedups over plain decoding (geomean, min, max), and
    lookup's acceptance by match length (`curve`: the recording's pass cost by size)."""
    k_max = recorded["k_max"]
    ratios, buckets = defaultdict(lambda: {"oracle": [], "adaptive": []}), defaultdict(lambda: [0, 0])
    for run in recorded["runs"]:
        name, prompt, output = run["set"], run["prompt"], run["output"]
        r = replay(prompt, output, curve, k_max)
        adaptive = policy_replay(prompt, output, recorded["costs"], AdaptiveK(k_max=k_max))
        ratios[name]["oracle"].append(r["t_plain"] / r["t_oracle"])
        ratios[name]["adaptive"].append(r["t_plain"] / adaptive["t_policy"])
        for b, (a, t) in r["by_bucket"].items():
            buckets[(name, b)][0] += a
            buckets[(name, b)][1] += t
        print(f"{name}/{run['id']}: oracle lookup {ratios[name]['oracle'][-1]:.3f}x plain, adaptive K "
              f"{ratios[name]['adaptive'][-1]:.3f}x (decode only)", flush=True)
    rows = {name: {kind: {"geomean": statistics.geometric_mean(v), "min": min(v), "max": max(v)}
                   for kind, v in by_kind.items()} for name, by_kind in ratios.items()}
    acceptance = {name: {_label(b): {"alpha": a / t, "tested": t} for (s, b), (a, t) in sorted(buckets.items())
                         if s == name and t} for name in ratios}
    return rows, acceptance


def _label(bucket: tuple[int, int]) -> str:
    return f"{bucket[0]}-{bucket[1]}" if bucket[1] < 10**9 else f">={bucket[0]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", default=list(PROMPT_SETS))
    ap.add_argument("--prompts-per-set", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="bench-out/lookup-bound")
    ap.add_argument("--save-outputs", metavar="FILE", help="keep the greedy outputs and the curve here")
    ap.add_argument("--replay", metavar="FILE", help="analyse outputs kept by --save-outputs (no model; --sets and "
                                                     "--prompts-per-set choose among them)")
    args = ap.parse_args()
    if unknown := set(args.sets) - set(PROMPT_SETS):
        ap.error(f"unknown prompt set(s) {sorted(unknown)}; choose from {', '.join(PROMPT_SETS)}")
    if args.prompts_per_set < 1 or args.max_new_tokens < 1:
        ap.error("--prompts-per-set and --max-new-tokens must be >= 1")

    if args.replay:
        recorded = load_recording(Path(args.replay), args.sets, args.prompts_per_set, ap.error)
    else:
        recorded = record(args.sets, args.prompts_per_set, args.max_new_tokens)
        if args.save_outputs:
            Path(args.save_outputs).write_text(json.dumps(recorded))
    curve = {int(n): t for n, t in recorded["costs"]["t_verify"].items()}
    rows, acceptance = analyse(recorded, curve)
    sets = list(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lookup_bound.json").write_text(json.dumps({"curve_ms": {n: 1000 * t for n, t in curve.items()},
                                                       "speedup": rows, "acceptance_by_match": acceptance}, indent=1))
    lines = ["# Prompt lookup on this machine: the oracle bound and adaptive K (greedy, decode only)", "",
             "Target cost curve (ms): " + ", ".join(f"{n}: {1000 * t:.0f}" for n, t in sorted(curve.items())), "",
             "Speedup over plain decoding, geomean over prompts (min-max):", "",
             "| set | oracle lookup | adaptive K (replayed) |", "|---|---|---|"]
    cell = lambda r: f"{r['geomean']:.3f}x ({r['min']:.2f}-{r['max']:.2f})"  # noqa: E731
    lines += [f"| {s} | {cell(r['oracle'])} | {cell(r['adaptive'])} |" for s, r in rows.items()]
    lines += ["", "Acceptance of lookup's drafts by the length of the match they continue (tokens):", "",
              "| set | " + " | ".join(_label(b) for b in MATCH_BUCKETS) + " |", "|---|" + "---|" * len(MATCH_BUCKETS)]
    for s in sets:
        cells = [acceptance[s].get(_label(b)) for b in MATCH_BUCKETS]
        lines.append(f"| {s} | " + " | ".join(f"{c['alpha']:.2f} ({c['tested']})" if c else "-" for c in cells)
                     + " |")
    lines += ["", "Command: `python benchmarks/lookup_bound.py " + " ".join(sys.argv[1:]) + "`"]
    (out / "lookup_bound.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
