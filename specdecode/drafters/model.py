"""The draft-model drafter: a smaller LM sampling K tokens with its own KV cache.

The draft cache holds a prefix of what it has seen. Each round it is synced with
the context by keeping the longest common prefix and feeding the rest in one
pass. That one mechanism covers both rollback cases:
- rejection after n accepted: the cache is cut back to context + n accepted, and
  the correction token is fed;
- all K accepted: the last draft token was sampled but never fed, so it is fed
  now together with the bonus token (the catch-up).
A longer catch-up (the prompt, or text emitted while the drafter sat out) is fed
as its own pass, so the reported per-step time is the marginal cost of a draft token.

Batching: each slot of a batch drafts on its own sequence of the draft model (`fork`), and
`draft_together` runs their drafting in lockstep (`drafting` yields each pass it needs): the
catch-ups in one pass, then each draft step of every sequence still drafting in one pass, so
K draft steps cost K batched passes, not K per sequence.

The draft never runs past its own context (`model.max_length`), which may be shorter
than the target's: K is cut to the room left, and once the context itself no longer
fits, the drafter proposes nothing and the loop takes plain target steps.

Confidence stop (optional): drafting ends early when the draft's own top
probability (of its raw, temperature-1 distribution, so it also works for greedy)
falls below `min_confidence`. It decides only how many tokens to propose, from the
draft alone, before any verification, so the output law is unchanged.

Draft tree (optional, `tree` > 0 extra nodes): after the chain, each depth may get alternative
candidates beside the chain's token, as siblings verified by the multi-candidate rule
(`core/tree.py`). Where they go is EAGLE-2's idea, by draft confidence: the m-th alternative at
depth i is worth reach_i * q_i's m-th most likely other token (reach_i: the product of the
draft's top probabilities above depth i), and the `tree` best such slots above `min_gain` are
taken. The slots are chosen from the chain alone, before any alternative is drawn; then the
alternatives are drawn without replacement from q_i minus the chain's token (sampled), or are
q_i's next most likely tokens (greedy: deterministic candidates, ranked by the raw
distribution). They cost no draft step: the draft never runs on them.

Copies (optional, `branches`: prompt lookup or the suffix drafter): at each depth of the chain,
what the free drafter continues the path with (context plus the chain above) becomes a branch
when it leaves the chain: its first token a deterministic sibling of the chain's token, the rest
of the copy a chain below it, no deeper than K (lookup's text joins the draft model's tree, and
the tree branches below a node the draft never ran on). A copy's nodes share its head's gain,
reach_i * q_i(head) (a copy is right or wrong as a block); the head is taken out of the
pool the alternatives of its depth are drawn from, so they never repeat it.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from specdecode.backends.protocol import Model, Row, common_prefix, forward_batch
from specdecode.checks import integer
from specdecode.core.probs import SamplingParams, argmax, logits_to_probs
from specdecode.core.reproducible import sample_token
from specdecode.core.tree import remove
from specdecode.drafters.protocol import ContinuationSource, Drafter, Drafting, Proposal


def draft_together(draftings: list[Drafting], steps: list[tuple[int, float]] | None = None) -> list[Proposal]:
    """Several sequences' drafting in lockstep: every catch-up in one pass, then one pass per draft
    step over the sequences still drafting (each leaves at its own K or confidence stop). Each
    sequence samples from its own generator, so what it drafts does not depend on its batch.
    `steps`, if given, gets (rows, seconds) of each draft step's pass: what a step costs by the
    number of sequences in it (the catch-up pass is not a step)."""
    proposals: list[Proposal | None] = [None] * len(draftings)
    waiting: dict[int, Row | None] = {}
    for i, drafting in enumerate(draftings):
        try:
            waiting[i] = next(drafting)
        except StopIteration as end:
            proposals[i] = end.value
    catchup = True  # the first yield of every drafting is its catch-up (or None)
    while waiting:
        ready = [i for i, row in waiting.items() if row is not None]
        t0 = time.perf_counter()
        logits = dict(zip(ready, forward_batch([waiting[i] for i in ready]))) if ready else {}
        after: dict[int, Row | None] = {}
        for i in waiting:
            try:
                after[i] = draftings[i].send(logits.get(i))
            except StopIteration as end:
                proposals[i] = end.value
        if steps is not None and ready and not catchup:  # the pass and each row's sample from it
            steps.append((len(ready), time.perf_counter() - t0))
        catchup = False
        waiting = after
    return proposals  # type: ignore[return-value]


def _one_hot(like: torch.Tensor, x: int) -> torch.Tensor:
    """The q of a deterministic candidate x: a one-hot row shaped like `like`."""
    return torch.zeros_like(like).index_fill_(0, torch.tensor([x], device=like.device), 1.0)


class ModelDrafter(Drafter):
    free = False  # each guess is a draft-model step
    lockstep = True  # `drafting`: its steps run with the other rows' (`draft_together`)

    def __init__(self, model: Model, min_confidence: float = 0.0, tree: int = 0, min_gain: float = 0.02,
                 branches: ContinuationSource | None = None) -> None:
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        if integer(tree) is None or tree < 0:
            raise ValueError(f"tree must be an integer >= 0 (extra tree nodes per round; 0 = a chain), got {tree!r}")
        self.model = model
        self.min_confidence = min_confidence
        self.tree, self.min_gain = tree, min_gain
        self.branches = branches  # a free drafter whose continuations join the tree (module docstring)
        self.name = "model"
        self._fed: list[int] = []  # the tokens whose K/V the draft cache holds, in order

    def reset(self) -> None:
        self.model.truncate(0)
        self._fed = []
        if self.branches is not None:
            self.branches.reset()

    @property
    def signature(self) -> str:
        return f"{self.name}({self.model.signature})"

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Proposal:
        """`drafting` run alone. The engine runs `drafting` itself (with the batch's other rows), so a
        subclass changes what it proposes there, not here."""
        return draft_together([self.drafting(context, k, params, generator)])[0]

    def drafting(self, context: Sequence[int], k: int, params: SamplingParams,
                 generator: torch.Generator) -> "Drafting":
        """`propose` as the passes it needs, for `draft_together` to run several sequences' drafts
        in lockstep: yields the catch-up pass's Row (None when in sync), then each draft step's
        Row, is sent each pass's logits, and returns the Proposal."""
        # Never run past the draft's own context (it may be shorter than the target's): drafting
        # k tokens feeds len(context) + k - 1 of them (the last draft is not fed). With no room
        # for even the context, propose nothing: the loop then takes a plain target step.
        k = min(k, self.model.max_length - len(context) + 1)
        if k < 1:
            return Proposal([], None)
        self._rollback_to_common_prefix(context)
        feed = list(context[len(self._fed):])
        if len(feed) > 2:  # catch up separately: a long feed is not the cost of a draft step
            yield Row(self.model, feed[:-1], 1)
            self._fed.extend(feed[:-1])
            feed = feed[-1:]
        else:
            yield None
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        ranks: list[torch.Tensor] = []  # what alternatives are ranked by (the raw distribution when greedy)
        t0 = time.perf_counter()
        for _ in range(k):
            logits = yield Row(self.model, feed, 1)
            self._fed.extend(feed)
            raw = torch.softmax(logits[0].float(), -1) if self.min_confidence or params.greedy else None
            if self.min_confidence and float(raw.max()) < self.min_confidence:
                break
            q_i = logits_to_probs(logits[0], params)
            # the position of this draft in the whole sequence: reproducible sampling's noise is keyed by it
            x = sample_token(q_i, generator, len(context) + len(tokens), params.greedy)
            tokens.append(x)
            rows.append(q_i)
            ranks.append(raw if params.greedy else q_i)
            feed = [x]  # the last draft is not fed this round: the next sync catches it up
        # per step of this sequence: in a batch, a step's pass carries the other sequences' steps too
        step = (time.perf_counter() - t0) / max(1, len(tokens))
        if self.tree and tokens:
            return self._with_alternatives(context, tokens, rows, ranks, params, generator, step)
        return Proposal(tokens, torch.stack(rows) if rows else None, step_seconds=step)

    def _with_alternatives(self, context: Sequence[int], chain: list[int], rows: list[torch.Tensor],
                           ranks: list[torch.Tensor], params: SamplingParams, generator: torch.Generator,
                           step: float) -> Proposal:
        """The chain plus up to `tree` extra nodes (module docstring) as a tree proposal: nodes
        0..K-1 are the chain; each extra node is an alternative beside chain node i, or a node of
        a copy (the branch source's continuation where it leaves the chain) and its descendants.

        Every slot, its gain and each copy are decided from the chain alone, before any
        alternative is drawn, so which nodes the cost model keeps never depends on a sampled
        alternative's value. A copy's head is excluded from the sampled alternatives of its depth,
        so they never duplicate it, and each alternative's q is the law it was drawn from."""
        position = len(context)
        slots, reach = [], 1.0  # (gain, order, depth i, copy node index or None for an alternative)
        copies: list[list[int]] = []
        for i, (x, rank) in enumerate(zip(chain, ranks)):
            copy = self.branches.continuation(context, chain[:i], len(chain) - i) if self.branches else []
            copies.append(copy if copy and copy[0] != x else [])
            if copies[i]:  # every node of a copy stands or falls with its head: the head's gain
                gain = reach * float(rank[copies[i][0]])
                slots += [(gain, len(slots) + j, i, j) for j in range(len(copies[i])) if gain >= self.min_gain]
            top = torch.topk(rank, min(self.tree + 2, rank.numel()))
            others = [v for v, t in zip(top.values.tolist(), top.indices.tolist())
                      if t != x and t not in copies[i][:1]][:self.tree]
            slots += [(reach * v, len(slots) + n, i, None) for n, v in enumerate(others) if reach * v >= self.min_gain]
            reach *= float(top.values[0])
        # the best slots; a copy's nodes tie with its head and follow it in order, so a kept node's parent is kept
        chosen = sorted(slots, key=lambda s: (-s[0], s[1]))[:self.tree]
        tokens, parents, q_rows, gains = list(chain), list(range(-1, len(chain) - 1)), list(rows), []
        for i in range(len(chain)):
            here = [s for s in chosen if s[2] == i]
            if not here:
                continue
            pool = remove(rows[i] if not params.greedy else ranks[i], chain[i])
            if any(s[3] is not None for s in here):
                pool = remove(pool, copies[i][0])  # the copy's head is this depth's candidate, not the pool's
            for gain, _, _, j in here:
                if j is not None:  # the copy's j-th node: below the chain's node i - 1, then below its own
                    x, q_x, parent = copies[i][j], _one_hot(rows[i], copies[i][j]), i - 1 if j == 0 else len(tokens) - 1
                elif params.greedy:  # deterministic: the next most likely token, q one-hot
                    x = int(argmax(pool))
                    q_x, parent = _one_hot(rows[i], x), i - 1
                elif bool(pool.sum() > 0):  # sampled without replacement from q_i minus what was drawn
                    x, q_x, parent = sample_token(pool, generator, position + i, False), pool, i - 1
                else:
                    continue
                if j is None:
                    pool = remove(pool, x)
                tokens.append(x)
                parents.append(parent)
                q_rows.append(q_x)
                gains.append(gain)
        if len(tokens) == len(chain):
            return Proposal(chain, torch.stack(rows), step_seconds=step)
        return Proposal(tokens, torch.stack(q_rows), step_seconds=step, parents=parents, gains=gains)

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of `context` this drafter would feed as a separate catch-up pass before drafting
        (0 when in sync: up to two new tokens go into the first draft step itself)."""
        feed = len(context) - self._common_prefix(context)
        return feed - 1 if feed > 2 else 0

    def fork(self) -> "ModelDrafter":
        """Another slot's draft: a sibling sequence of the draft model (its own cache; on llama.cpp
        the same context, so `draft_together` runs the slots' draft steps in one pass)."""
        return ModelDrafter(self.model.sibling(), self.min_confidence, self.tree, self.min_gain,
                            None if self.branches is None else self.branches.fork())

    def observe(self, drafted: int, accepted: int) -> None:
        pass  # rollback happens lazily at the next sync, from the context itself

    def _common_prefix(self, context: Sequence[int]) -> int:
        # keep >= 1 token to feed: it yields q_1
        return min(common_prefix(self._fed, context), len(context) - 1)

    def _rollback_to_common_prefix(self, context: Sequence[int]) -> None:
        common = self._common_prefix(context)
        if common < len(self._fed) or self.model.length != len(self._fed):  # a failed pass may have left cells
            keep = min(common, self.model.length)
            self.model.truncate(keep)
            del self._fed[keep:]
