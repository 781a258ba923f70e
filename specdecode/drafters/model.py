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
"""

from __future__ import annotations

from typing import Sequence

import time

import torch

from specdecode.backends.protocol import Model
from specdecode.core.probs import SamplingParams, logits_to_probs
from specdecode.core.reproducible import sample_token
from specdecode.core.tree import remove
from specdecode.drafters.protocol import Proposal


class ModelDrafter:
    def __init__(self, model: Model, min_confidence: float = 0.0, tree: int = 0, min_gain: float = 0.02) -> None:
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {min_confidence}")
        if isinstance(tree, bool) or not isinstance(tree, int) or tree < 0:
            raise ValueError(f"tree must be an integer >= 0 (extra tree nodes per round; 0 = a chain), got {tree!r}")
        self.model = model
        self.min_confidence = min_confidence
        self.tree, self.min_gain = tree, min_gain
        self.name = "model"
        self._fed: list[int] = []  # the tokens whose K/V the draft cache holds, in order

    def reset(self) -> None:
        self.model.truncate(0)
        self._fed = []

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Proposal:
        # Never run past the draft's own context (it may be shorter than the target's): drafting
        # k tokens feeds len(context) + k - 1 of them (the last draft is not fed). With no room
        # for even the context, propose nothing: the loop then takes a plain target step.
        k = min(k, self.model.max_length - len(context) + 1)
        if k < 1:
            return Proposal([], None)
        self._rollback_to_common_prefix(context)
        feed = list(context[len(self._fed):])
        if len(feed) > 2:  # catch up separately: a long feed is not the cost of a draft step
            self.model.forward(feed[:-1], n_logits=1)
            self._fed.extend(feed[:-1])
            feed = feed[-1:]
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        ranks: list[torch.Tensor] = []  # what alternatives are ranked by (the raw distribution when greedy)
        t0 = time.perf_counter()
        for _ in range(k):
            logits = self.model.forward(feed, n_logits=1)
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
        step = (time.perf_counter() - t0) / max(1, len(tokens))
        if self.tree and tokens:
            return self._with_alternatives(tokens, rows, ranks, len(context), params, generator, step)
        return Proposal(tokens, torch.stack(rows) if rows else None, step_seconds=step)

    def _with_alternatives(self, chain: list[int], rows: list[torch.Tensor], ranks: list[torch.Tensor],
                           position: int, params: SamplingParams, generator: torch.Generator,
                           step: float) -> Proposal:
        """The chain plus up to `tree` alternative candidates (module docstring) as a tree proposal:
        nodes 0..K-1 are the chain, alternatives follow, each the sibling of chain node i at depth i."""
        slots, reach = [], 1.0
        for i, (x, rank) in enumerate(zip(chain, ranks)):  # gains from the chain alone
            top = torch.topk(rank, min(self.tree + 1, rank.numel()))
            others = [v for v, t in zip(top.values.tolist(), top.indices.tolist()) if t != x][:self.tree]
            slots += [(reach * v, i) for v in others if reach * v >= self.min_gain]
            reach *= float(top.values[0])
        count, gains = [0] * len(chain), [[] for _ in chain]
        for gain, i in sorted(slots, reverse=True)[:self.tree]:
            count[i] += 1
            gains[i].append(gain)
        tokens, parents, q_rows, kept_gains = list(chain), list(range(-1, len(chain) - 1)), list(rows), []
        for i, m in enumerate(count):
            drawn = rows[i] if not params.greedy else ranks[i]
            drawn = remove(drawn, chain[i])
            for j in range(m):
                if params.greedy:  # deterministic: the next most likely token, q one-hot
                    x = int(drawn.argmax())
                    q_x = torch.zeros_like(rows[i]).index_fill_(0, torch.tensor([x], device=rows[i].device), 1.0)
                elif bool(drawn.sum() > 0):  # sampled without replacement from q_i minus what was drawn
                    x, q_x = sample_token(drawn, generator, position + i, False), drawn
                else:
                    break
                tokens.append(x)
                parents.append(i - 1)
                q_rows.append(q_x)
                kept_gains.append(gains[i][j])
                drawn = remove(drawn, x)
        if len(tokens) == len(chain):
            return Proposal(chain, torch.stack(rows), step_seconds=step)
        return Proposal(tokens, torch.stack(q_rows), step_seconds=step, parents=parents, gains=kept_gains)

    def lag(self, context: Sequence[int]) -> int:
        """Tokens of `context` this drafter would feed as a separate catch-up pass before drafting
        (0 when in sync: up to two new tokens go into the first draft step itself)."""
        feed = len(context) - self._common_prefix(context)
        return feed - 1 if feed > 2 else 0

    def fork(self) -> "ModelDrafter":
        """Another slot's draft: a sibling sequence of the draft model (its own cache). Its draft
        steps run per sequence, not batched across the slots (README, batching)."""
        return ModelDrafter(self.model.sibling(), self.min_confidence, self.tree, self.min_gain)

    def observe(self, drafted: int, accepted: int) -> None:
        pass  # rollback happens lazily at the next sync, from the context itself

    def _common_prefix(self, context: Sequence[int]) -> int:
        n = min(len(self._fed), len(context) - 1)  # keep >= 1 token to feed: it yields q_1
        common = 0
        while common < n and self._fed[common] == context[common]:
            common += 1
        return common

    def _rollback_to_common_prefix(self, context: Sequence[int]) -> None:
        common = self._common_prefix(context)
        if common < len(self._fed):
            self.model.truncate(common)
            del self._fed[common:]
