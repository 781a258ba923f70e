"""The drafter protocol: propose up to k tokens with the distributions they came from.

`q` must be exactly the distribution each token was drawn from (after the same
temperature/top-k/top-p processing as the target), or None for a deterministic
drafter, whose q is one-hot at the proposed token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Hashable, Protocol, Sequence

import torch

from specdecode.backends.protocol import Row
from specdecode.core.probs import SamplingParams


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]  # 0 <= len <= k drafted tokens
    q: torch.Tensor | None  # [len, V]; None = deterministic drafter (one-hot q)
    # mean time of one draft step, excluding catching up on context the drafter had not seen
    # (a K policy needs the marginal cost of a drafted token); None = not measured
    step_seconds: float | None = None
    # a draft tree (core/tree.py): each token's parent (an earlier index, -1 = the root); None = a
    # chain. q's row j is then node j's law given its earlier siblings.
    parents: list[int] | None = None
    # a tree's alternatives (the nodes after its chain, in order): each one's expected extra tokens
    # as the drafter estimates them, non-increasing among the alternatives of one depth and never
    # above the gain of an alternative it hangs below
    gains: list[float] | None = None

    def keep_alternatives(self, m: int) -> "Proposal":
        """This tree with only its m best alternatives (by gain; ties: the earlier). Within a depth
        the kept ones are the first drawn, so the count is decided by gains known before any was
        drawn and what is kept is still what the rule assumes (core/tree.py)."""
        if self.parents is None or not self.gains or m >= len(self.gains):
            return self
        first = len(self.tokens) - len(self.gains)
        best = sorted(range(len(self.gains)), key=lambda i: (-self.gains[i], i))[:m]
        keep = list(range(first)) + sorted(first + i for i in best)
        if len(keep) == first:  # the chain alone
            return Proposal(self.tokens[:first], None if self.q is None else self.q[:first], self.step_seconds)
        index = {old: new for new, old in enumerate(keep)} | {-1: -1}
        if any(self.parents[j] not in index for j in keep):
            raise ValueError("a kept alternative's parent was dropped: a node's gain must not exceed its parent's")
        return Proposal([self.tokens[j] for j in keep], None if self.q is None else self.q[keep], self.step_seconds,
                        [index[self.parents[j]] for j in keep], [self.gains[i] for i in sorted(best)])


@dataclass(frozen=True, slots=True)
class Situation:
    """A drafter's class of a round (`Drafter.situation`) with the acceptance it measured for that
    class: adaptive K starts a class it has no evidence for at `prior` (a bare hashable situation
    starts neutral). Equal keys must carry equal priors: the pair is the evidence's key."""

    key: Hashable
    prior: float

    def __post_init__(self) -> None:
        if not 0.0 < self.prior < 1.0:
            raise ValueError(f"a situation's prior acceptance must be in (0, 1), got {self.prior!r}")


class ContinuationSource(Protocol):
    """A deterministic drafter that can continue any path below the context (prompt lookup, the
    suffix drafter): the draft model hangs its continuations in its tree as branches."""

    name: str

    def reset(self) -> None: ...

    def continuation(self, context: Sequence[int], path: Sequence[int], k: int) -> list[int]:
        """Up to k tokens continuing context + path (path: draft tokens, not part of the text)."""

    def fork(self) -> "ContinuationSource": ...


class Drafter(Protocol):
    """What proposes a round's drafts. What a drafter may do beyond `propose` is declared on it, with
    a default here: a drafter subclasses `Drafter` and overrides what it has."""

    name: str
    # free: proposing runs no model and q is one-hot (prompt lookup, the suffix drafter). In rounds
    # where adaptive K gives it K = 0 the engine still asks for its first token (`continuation(context,
    # (), 1)`, which a free drafter has), and the target's p there tells the policy how often it would
    # have been accepted.
    free: bool = False
    # lockstep: it drafts by steps of a draft model, which `drafting` yields so that the rows of a batch
    # run each step in one pass (drafters/model.py's `draft_together`); it may fall behind the context
    # (`lag`), and calibration times its catch-up.
    lockstep: bool = False

    def reset(self) -> None:
        """A new request starts: forget its state (a drafter may keep a bounded history of earlier requests)."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Proposal:
        """Draft up to k tokens continuing `context` (the prompt plus everything emitted).

        `generator` is the sequence's randomness: a drafter that samples draws its token at
        sequence position `len(context) + i` with `core.reproducible.sample_token`, which also
        serves reproducible mode (there `generator` is a `CounterNoise`)."""

    def observe(self, drafted: int, accepted: int) -> None:
        """Told after verification how many of the drafted tokens the target accepted."""

    def fork(self) -> "Drafter":
        """A drafter of the same kind for another sequence running at the same time (a batch
        slot): its own per-sequence state, the same weights."""

    @property
    def signature(self) -> str:
        """What its cost depends on (the calibration file's key): its name, and a draft model's own."""
        return self.name

    def situation(self, context: Sequence[int]) -> Hashable | None:
        """A class of this round (prompt lookup: its match's length) under which adaptive K keeps a
        separate acceptance estimate; a `Situation` also says what acceptance to assume before the
        request gives evidence for it. None: one estimate for every round."""
        return None

    def continuation(self, context: Sequence[int], path: Sequence[int], k: int) -> list[int]:
        """A free drafter's: up to k tokens continuing context + path (a `ContinuationSource`)."""
        raise NotImplementedError(f"{self.name} is not a free drafter")

    def lag(self, context: Sequence[int]) -> int:
        """A lockstep drafter's: tokens of `context` it must catch up on before drafting."""
        return 0

    def drafting(self, context: Sequence[int], k: int, params: SamplingParams,
                 generator: torch.Generator) -> "Drafting":
        """A lockstep drafter's `propose` as the passes it needs: yields each pass's Row (the first may
        be None), is sent its logits, returns the Proposal."""
        raise NotImplementedError(f"{self.name} does not draft in lockstep")


# a lockstep drafter's drafting as the passes it needs (`Drafter.drafting`): yields Rows (the first
# may be None), is sent their logits, returns the Proposal
Drafting = Generator["Row | None", "torch.Tensor | None", Proposal]
