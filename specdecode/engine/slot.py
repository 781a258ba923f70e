"""A slot: one row of the machine, a sequence of the target (its own KV cache) and the drafters'
state for it. A batch holds one request per slot; `prefill` puts a prompt into a slot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specdecode.backends.protocol import Model
from specdecode.drafters.protocol import Drafter


@dataclass(frozen=True, slots=True)
class Slot:
    """A sequence of the target (its own cache) and the drafters that serve it."""

    target: Model
    drafters: tuple[Drafter, ...] = ()


def prefill(target: Model, drafters: Sequence[Drafter], prompt: Sequence[int], keep: int = 0, run: bool = True) -> int:
    """Start a sequence: the target's cache cut to its first `keep` cells (which must hold
    prompt[:keep]: a reused prefix), drafters emptied, then (unless not `run`: the caller runs it)
    the rest of the prompt minus its last token (the first `pending`) into the target. Returns the
    target's cache length, to restore the prefix later by truncating."""
    if not 0 <= keep <= min(target.length, len(prompt) - 1):
        raise ValueError(f"cannot keep {keep} cached tokens of a {len(prompt)}-token prompt "
                         f"({target.length} in the cache)")
    target.truncate(keep)
    for d in drafters:
        d.reset()
    if run and len(prompt) - 1 > keep:
        target.forward(list(prompt[keep:-1]), n_logits=1)
    return target.length
