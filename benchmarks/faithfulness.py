"""The native backend's faithfulness gate: teacher-forced next-token agreement with llama.cpp on the
three prompt sets (top-1 >= 99.5%, mean KL), and greedy text equal to llama.cpp's except at listed
near-ties (specdecode/bench/faithfulness.py says how). Both models of the embedded pair:

    python benchmarks/faithfulness.py --out benchmarks/results/faithfulness-MACHINE-DATE
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from specdecode.backends.llamacpp import LlamaCppModel, LlamaSettings, LlamaWeights
from specdecode.backends.native import NativeModel, NativeSettings, NativeWeights
from specdecode.backends.weights import DRAFT, TARGET, cache_dir, ensure_gguf, gguf_tokenizer
from specdecode.bench.faithfulness import GATE_TOP1, NEAR_TIE, Faithfulness, compare
from specdecode.bench.harness import load_prompts
from specdecode.engine.loading import eos_ids

SETS = ("chat", "codegen", "codeedit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=96, help="continuation tokens per prompt (default 96)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per set (default 0 = all 8)")
    ap.add_argument("--kernel", default="auto", help="the native kernels' path (default auto)")
    ap.add_argument("--out", default="bench-out/faithfulness", help="result folder (default bench-out/faithfulness)")
    args = ap.parse_args()
    report = {"kernel": None, "new_tokens": args.new_tokens, "gate_top1": GATE_TOP1, "near_tie": NEAR_TIE, "models": {}}
    lines = []
    for role, spec in (("target", TARGET), ("draft", DRAFT)):
        path = ensure_gguf(spec, progress=False)
        tokenizer = gguf_tokenizer(path)
        ours = NativeModel(NativeWeights(path, NativeSettings(kernel=args.kernel), role, cache=cache_dir() / "native"))
        report["kernel"] = ours.weights.kernel
        theirs = LlamaCppModel(LlamaWeights(path, role), LlamaSettings(n_ctx=4096))
        eos = eos_ids(tokenizer, ours)
        total = Faithfulness()
        for name in SETS:
            items = load_prompts(name)[: args.prompts or None]
            part = Faithfulness()
            for item in tqdm(items, desc=f"{role} {name}"):
                ids = tokenizer.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                                    add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # some versions: a BatchEncoding
                compare(ours, theirs, [(f"{name}/{item['id']}", ids)], args.new_tokens, eos, part)
            total.per_set[name] = {"positions": part.positions, "top1": part.top1, "self_top1": part.self_top1,
                                   "mean_kl": part.mean_kl,
                                   "greedy_same": part.greedy_same, "prompts": part.prompts}
            for k in ("positions", "agree", "self_agree", "greedy_same", "prompts"):
                setattr(total, k, getattr(total, k) + getattr(part, k))
            total.kl_sum += part.kl_sum
            total.kl_max = max(total.kl_max, part.kl_max)
            total.max_logit_diff = max(total.max_logit_diff, part.max_logit_diff)
            total.divergences += part.divergences
        report["models"][role] = total.as_json()
        lines += [f"## {role} ({spec.name})", "",
                  "| set | positions | top-1 agreement | llama.cpp with itself | mean KL | greedy texts equal |",
                  "|---|---|---|---|---|---|"]
        for name, s in total.per_set.items():
            lines.append(f"| {name} | {s['positions']} | {100 * s['top1']:.2f}% | {100 * s['self_top1']:.2f}% | "
                         f"{s['mean_kl']:.2e} | "
                         f"{s['greedy_same']} / {s['prompts']} |")
        lines.append(f"| all | {total.positions} | {100 * total.top1:.2f}% | {100 * total.self_top1:.2f}% | "
                     f"{total.mean_kl:.2e} | "
                     f"{total.greedy_same} / {total.prompts} |")
        lines += ["", f"Max |logit difference| {total.max_logit_diff:.3f}, max KL {total.kl_max:.2e}. 'llama.cpp with "
                      f"itself': its one-pass logits against its one-token-a-pass logits. Gate (top-1 >= "
                      f"{100 * GATE_TOP1:.1f}%, or where llama.cpp agrees with itself less, at least that: here "
                      f"{100 * total.bar:.2f}%; every greedy divergence a near-tie of llama.cpp's logits, margin <= "
                      f"{NEAR_TIE}): **{'pass' if total.passes_gate else 'FAIL'}**.", ""]
        if total.divergences:
            lines += ["| prompt | step | ours | llama.cpp | llama.cpp's top-2 margin | near-tie |", "|---|---|---|---|---|---|"]
            for d in total.divergences:
                lines.append(f"| {d.prompt} | {d.step} | {tokenizer.decode([d.ours])!r} | {tokenizer.decode([d.theirs])!r} "
                             f"| {d.margin:.3f} | {'yes' if d.near_tie else 'no'} |")
            lines.append("")
        del ours, theirs
    lines.insert(0, f"# Faithfulness of the native backend ({report['kernel']}) to llama.cpp, {args.new_tokens} "
                    f"greedy tokens per prompt\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faithfulness.json").write_text(json.dumps(report, indent=1))
    (out / "faithfulness.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
