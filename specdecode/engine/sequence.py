"""Per-request state: what a batch holds for each sequence while it runs.

A `Slot` is one row of the machine: a sequence of the target (its own KV cache) and
the drafters' state for it. A `Sequence` is one request running in a slot: its
prompt, frozen config, own random generator (so its law never depends on what it is
batched with), own K policy state (its acceptance estimate), statistics, and output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from specdecode.backends.protocol import Model
from specdecode.core.reproducible import CounterNoise
from specdecode.core.verify import VerifyResult
from specdecode.drafters.protocol import Drafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.policy import KPolicy
from specdecode.engine.stats import GenerationStats

VerifyRule = Callable[..., VerifyResult]  # verify's signature: (draft_tokens, q, p, rand) -> VerifyResult


@dataclass(frozen=True, slots=True)
class Slot:
    """A sequence of the target (its own cache) and the drafters that serve it."""

    target: Model
    drafters: tuple[Drafter, ...] = ()


@dataclass(eq=False, slots=True)
class Sequence:
    prompt: list[int]
    config: GenerationConfig
    slot: Slot
    policy: KPolicy
    rule: VerifyRule
    generator: torch.Generator | CounterNoise  # the sequence's own randomness (CounterNoise: reproducible mode)
    eos_ids: frozenset[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    speculative: bool = True  # False: no drafts (plain decoding rows in a speculative batch)
    tokens: list[int] = field(default_factory=list)  # the output so far
    finished: bool = False
    # prompt tokens before `pending` that the target has not run yet (`loop.start` leaves the prompt's
    # rest here): the sequence's next row feeds them first, in the pass that yields its first token
    unfed: list[int] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def drafters(self) -> tuple[Drafter, ...]:
        return self.slot.drafters if self.speculative else ()

    @property
    def budget(self) -> int:
        """Tokens this sequence may still emit."""
        return self.config.max_new_tokens - len(self.tokens)
