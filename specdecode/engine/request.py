"""One request's state: what it asked for, where it runs and how far it has got.

A request is WAITING (added, no slot free yet), then PREFILLING (in a slot, the rest of its prompt
computed in pieces beside the running rows), DECODING (a row in every round: the first may carry
the prompt's rest, and yields the first token) and FINISHED (EOS, its budget, a stop string, its
context full, aborted, or failed). Its own generator, K policy and statistics make its law
independent of what it is batched with.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from specdecode.core.reproducible import CounterNoise
from specdecode.core.verify import VerifyResult
from specdecode.drafters.protocol import Drafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.policy import KPolicy
from specdecode.engine.slot import Slot
from specdecode.engine.stats import GenerationStats
from specdecode.engine.text import Chunk, TextAssembler

# a chain rule, `core.verify`'s signature: (draft_tokens, q, p, rand, lengths=None) -> VerifyResult; it
# names its tree version as `tree_rule`
VerifyRule = Callable[..., VerifyResult]


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    key: Hashable  # the caller's handle (a prompt's index, a server's job)
    prompt: list[int]
    config: GenerationConfig
    policy: KPolicy
    rule: VerifyRule
    generator: torch.Generator | CounterNoise  # its own randomness (CounterNoise: reproducible mode)
    eos_ids: frozenset[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    speculative: bool = True  # False: no drafts (a plain decoding row, in a speculative batch too)
    text: TextAssembler | None = None  # its text layer (None: token ids only, no stop strings)
    state: State = State.WAITING
    slot: Slot | None = None
    tokens: list[int] = field(default_factory=list)  # the output so far
    # prompt tokens before `pending` that the target has not run yet: its next row feeds them first, in
    # the pass that yields its first token (until then the cache holds context[:-1-len(unfed)])
    unfed: list[int] = field(default_factory=list)
    passed_over: int = 0  # rounds in a row its prompt waited for a piece of a pass (the scheduler's patience)
    error: Exception | None = None  # what ended it, if its round failed
    outbox: list[Chunk] = field(default_factory=list)  # chunks made and not yet taken (`take`)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def drafters(self) -> tuple[Drafter, ...]:
        return self.slot.drafters if self.speculative and self.slot is not None else ()

    @property
    def budget(self) -> int:
        """Tokens this request may still emit."""
        return self.config.max_new_tokens - len(self.tokens)

    @property
    def finished(self) -> bool:
        return self.state is State.FINISHED

    def take(self) -> list[Chunk]:
        """The chunks made since the last `take`, in order."""
        chunks, self.outbox = self.outbox, []
        return chunks
