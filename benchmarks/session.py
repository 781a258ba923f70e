"""A multi-turn editing session: one file edited over several requests, as a coding assistant is used.

Each turn asks for another edit of the same file and the whole file back; the conversation carries
the earlier turns, so every answer largely repeats the previous version of the file. Prompt lookup
finds that version in the prompt (and copies past the renames an edit makes; "lookup, no renames"
is the same drafter without that); the suffix drafter also remembers its own earlier answers. Every
method answers every turn from the same conversation (the history holds plain decoding's answers, so
all methods see identical prompts), the methods interleaved turn by turn, each with its own decoder on
one shared llama.cpp target. Reported: decode tokens/s (after the first tokens) per turn and method,
and each method against plain decoding over turns 2.. (geometric mean).

    python benchmarks/session.py --out benchmarks/results/session-MACHINE-DATE
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specdecode.bench.harness import MODES
from specdecode.drafters.lookup import LookupConfig, LookupDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder

from repeat import decode_rate  # noqa: E402  (benchmarks/ is on the path when run as a script)

FILES = {
    "inventory": '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        if name in self.items:
            self.items[name] += quantity
        else:
            self.items[name] = quantity

    def remove(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
        self.items[name] -= quantity
        if self.items[name] <= 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())
''',
    "stats": '''def mean(xs):
    return sum(xs) / len(xs)


def variance(xs):
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def median(xs):
    s = sorted(xs)
    n = len(s)
    if n % 2:
        return s[n // 2]
    return (s[n // 2 - 1] + s[n // 2]) / 2
''',
}
EDITS = [
    "Add type hints to every function and method. Reply with the whole file in one code block.",
    "Add a one-line docstring to every function and method. Reply with the whole file in one code block.",
    "Raise ValueError with a clear message where an empty input would fail. Reply with the whole file in one "
    "code block.",
    "Rename every parameter called xs or name to values or item. Reply with the whole file in one code block.",
]


def vs_plain(rows: list[dict], plain: list[dict], keep=lambda row: True) -> tuple[float | None, int]:
    """The geometric mean of a method's decode rate over plain decoding's on turns 2.. that `keep`
    accepts (None if none), and how many turns that is. Kept to the turns where the method wrote plain
    decoding's answer, it measures the drafter on the same text, free of which way a near-tie went."""
    ratios = [r["decode_tok_s"] / p["decode_tok_s"] for r, p in zip(rows, plain) if r["turn"] > 1 and keep(r)]
    return (statistics.geometric_mean(ratios) if ratios else None), len(ratios)


def shown(mean_turns: tuple[float | None, int]) -> str:
    mean, turns = mean_turns
    return "none" if mean is None else f"{mean:.2f}x ({turns} turns)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", nargs="+", default=list(FILES), choices=list(FILES))
    ap.add_argument("--turns", type=int, default=len(EDITS))
    ap.add_argument("--mode", default="greedy", choices=list(MODES))
    ap.add_argument("--max-new-tokens", type=int, default=320)
    ap.add_argument("--tree", type=int, default=0,
                    help="also run the suffix drafter with trees of up to N branch nodes (its own target context)")
    ap.add_argument("--out", default="bench-out/session")
    args = ap.parse_args()

    base = SpeculativeDecoder.load(drafter="auto", progress=False)  # lookup, then the draft model
    share = dict(eos_ids=base.eos_ids, calibration=base.calibration)
    decoders = {"plain": base, "lookup": SpeculativeDecoder(base.target, base.tokenizer, [LookupDrafter()], **share),
                "lookup, no renames": SpeculativeDecoder(base.target, base.tokenizer,
                                                         [LookupDrafter(LookupConfig(renames=False))], **share),
                "auto": base, "suffix": SpeculativeDecoder(base.target, base.tokenizer, [SuffixDrafter()], **share)}
    if args.tree:  # a tree pass needs a context with scratch sequences: loaded with the tree size
        decoders[f"suffix, tree {args.tree}"] = SpeculativeDecoder.load(drafter="suffix", tree=args.tree, progress=False)
    warm = base.encode(FILES[args.files[0]], chat=True)
    for decoder in {id(d): d for d in decoders.values()}.values():
        decoder.calibrate(warm)  # cached costs (or measured now), outside the timed runs
    rows: dict = {}
    for name in args.files:
        messages = []
        for turn, edit in enumerate(EDITS[: args.turns], start=1):
            ask = f"Here is a file:\n\n```python\n{FILES[name]}```\n\n{edit}" if turn == 1 else edit
            messages.append({"role": "user", "content": ask})
            ids = base.encode(messages)
            answers = {}
            for method, decoder in decoders.items():
                config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=MODES[args.mode], seed=turn)
                answers[method] = decode_rate(decoder, ids, config, speculative=method != "plain")
                rows.setdefault(method, []).append({"file": name, "turn": turn, "prompt_tokens": len(ids),
                                                    **{k: v for k, v in answers[method].items() if k != "ids"},
                                                    "same_as_plain": answers[method]["ids"] == answers["plain"]["ids"]})
            print(f"{name} turn {turn} ({len(ids)} prompt tokens): " + ", ".join(
                f"{m} {a['decode_tok_s']:.1f} tok/s ({a['tokens_per_round']:.2f}/round)" for m, a in answers.items()),
                flush=True)
            messages.append({"role": "assistant", "content": base.tokenizer.decode(answers["plain"]["ids"],
                                                                                   skip_special_tokens=True)})

    lines = [f"# A multi-turn editing session ({args.mode}): decode tokens/s per turn", "",
             "| file, turn | prompt tokens | " + " | ".join(decoders) + " |", "|---|---|" + "---|" * len(decoders)]
    for i, r in enumerate(rows["plain"]):
        lines.append(f"| {r['file']}, {r['turn']} | {r['prompt_tokens']} | " + " | ".join(
            f"{rows[m][i]['decode_tok_s']:.1f} ({rows[m][i]['tokens_per_round']:.2f}/round)"
            + ("" if rows[m][i]["same_as_plain"] or args.mode != "greedy" else " *") for m in decoders) + " |")
    summary = {m: vs_plain(rows[m], rows["plain"])[0] for m in decoders}
    everyone = {(r["file"], r["turn"]) for i, r in enumerate(rows["plain"]) if all(rows[m][i]["same_as_plain"] for m in decoders)}
    own = {m: vs_plain(rows[m], rows["plain"], lambda r: r["same_as_plain"]) for m in decoders}
    common = {m: vs_plain(rows[m], rows["plain"], lambda r: (r["file"], r["turn"]) in everyone) for m in decoders}
    lines += ["", "Against plain decoding, turns 2..: " + ", ".join(f"{m} {v:.2f}x" for m, v in summary.items())]
    if args.mode == "greedy":  # a sampled answer differs from plain decoding's by design (same law, other draws)
        lines += ["", "*: a different answer from plain decoding's (greedy near-ties that llama.cpp's batched passes "
                  "round the other way; a different text copies more or less of the prompt: one such turn of six "
                  "can move a method's mean by 15%)", "",
                  "Against plain decoding, turns 2.. where the method wrote plain decoding's answer: " + ", ".join(
                      f"{m} {shown(own[m])}" for m in decoders), "",
                  "... where every method did (the same texts for all): " + ", ".join(
                      f"{m} {shown(common[m])}" for m in decoders)]
    lines += ["", f"Command: `python benchmarks/session.py --mode {args.mode}" + (f" --tree {args.tree}`" if args.tree else "`"),
              f"Suffix drafter memory after the run: {decoders['suffix'].drafters[0].memory}"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = {"rows": rows, "vs_plain": summary, "vs_plain_own_same_answers": own, "vs_plain_common_same_answers": common}
    (out / f"session-{args.mode}.json").write_text(json.dumps(saved, indent=1))
    (out / f"session-{args.mode}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
