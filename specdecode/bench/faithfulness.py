"""Is a backend's model the GGUF's? Teacher-forced next-token agreement with llama.cpp, and greedy text.

For each prompt: llama.cpp writes a greedy continuation; both backends then read prompt + continuation
in one pass, and at every continuation position we compare their next-token distributions (top-1
agreement; KL(llama.cpp || ours)). The yardstick is llama.cpp against itself: its one-pass logits
against its logits fed one token a pass (it quantises activations per pass, so the two round apart at
near-ties; measured 98.6% top-1 on the embedded target, flash attention on against off 98.2%). Then each backend writes its own greedy continuation; where the
texts part, the step is listed with llama.cpp's top-2 margin there: a near-tie (a margin within what
llama.cpp itself moves between pass shapes, ~0.25-0.6 logits) may fall either way, a wide margin
would be a real difference. The gate: top-1 agreement >= 99.5%, or, where llama.cpp agrees with itself
less than that, at least as well as llama.cpp agrees with itself; and every greedy divergence a
near-tie. A path below it is no default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

GATE_TOP1 = 0.995
NEAR_TIE = 0.6  # logits: the most llama.cpp's own logits moved between pass shapes (backends/llamacpp.py)


@dataclass
class Divergence:
    prompt: str
    step: int          # index in the continuation where the greedy texts part
    ours: int
    theirs: int
    margin: float      # llama.cpp's top-1 minus top-2 logit at that step (its own forward of the shared prefix)

    @property
    def near_tie(self) -> bool:
        return self.margin <= NEAR_TIE


@dataclass
class Faithfulness:
    positions: int = 0
    agree: int = 0
    self_agree: int = 0  # llama.cpp one pass against llama.cpp one token a pass
    kl_sum: float = 0.0
    kl_max: float = 0.0
    max_logit_diff: float = 0.0
    greedy_same: int = 0
    prompts: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    per_set: dict = field(default_factory=dict)

    @property
    def top1(self) -> float:
        return self.agree / max(1, self.positions)

    @property
    def self_top1(self) -> float:
        return self.self_agree / max(1, self.positions)

    @property
    def bar(self) -> float:
        """The top-1 agreement the gate asks for."""
        return min(GATE_TOP1, self.self_top1)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(1, self.positions)

    @property
    def passes_gate(self) -> bool:
        return self.top1 >= self.bar and all(d.near_tie for d in self.divergences)

    def as_json(self) -> dict:
        return {**asdict(self), "top1": self.top1, "self_top1": self.self_top1, "bar": self.bar,
                "mean_kl": self.mean_kl, "passes_gate": self.passes_gate,
                "divergences": [{**asdict(d), "near_tie": d.near_tie} for d in self.divergences]}


def compare(ours, theirs, prompts: Sequence[tuple[str, list[int]]], new_tokens: int, eos: set[int],
            result: Faithfulness | None = None) -> Faithfulness:
    """`ours` and `theirs` (llama.cpp): Model-protocol sequences of the same GGUF; prompts: (name, ids)."""
    result = result if result is not None else Faithfulness()
    for name, ids in prompts:
        continuation = greedy(theirs, ids, new_tokens, eos)
        sequence = ids + continuation
        a = _logits(ours, sequence, len(continuation))
        b = _logits(theirs, sequence, len(continuation))
        b_steps = _logits_by_steps(theirs, sequence, len(continuation))
        result.self_agree += int((b.argmax(-1) == b_steps.argmax(-1)).sum())
        pa, pb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
        kl = (pb.exp() * (pb - pa)).sum(-1)
        result.positions += len(continuation)
        result.agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        result.kl_sum += float(kl.sum())
        result.kl_max = max(result.kl_max, float(kl.max()))
        result.max_logit_diff = max(result.max_logit_diff, float((a - b).abs().max()))
        mine = greedy(ours, ids, new_tokens, eos)
        result.prompts += 1
        if mine == continuation:
            result.greedy_same += 1
        else:
            step = next(i for i, (x, y) in enumerate(zip(mine + [-1], continuation + [-1])) if x != y)
            top2 = torch.topk(b[step].double(), 2).values if step < len(continuation) else None
            margin = float(top2[0] - top2[1]) if top2 is not None else 0.0
            result.divergences.append(Divergence(name, step, mine[step] if step < len(mine) else -1,
                                                 continuation[step] if step < len(continuation) else -1, margin))
    return result


def greedy(model, ids: list[int], new_tokens: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding, one token a pass (as the engine's plain steps)."""
    model.truncate(0)
    out: list[int] = []
    logits = model.forward(ids, 1)[0]
    while len(out) < new_tokens:
        token = int(logits.argmax())
        out.append(token)
        if token in eos:
            break
        logits = model.forward([token], 1)[0]
    return out


def _logits_by_steps(model, sequence: list[int], n: int) -> torch.Tensor:
    """The same logits as `_logits`, the continuation fed one token a pass."""
    model.truncate(0)
    rows = [model.forward(sequence[:-n], 1)[0]]
    for token in sequence[-n:-1]:
        rows.append(model.forward([token], 1)[0])
    model.truncate(0)
    return torch.stack(rows)


def _logits(model, sequence: list[int], n: int) -> torch.Tensor:
    """Next-token logits at the last n positions before the end: those that predict the continuation."""
    model.truncate(0)
    logits = model.forward(sequence[:-1], n)
    model.truncate(0)
    return logits
