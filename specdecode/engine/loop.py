"""The speculative decoding loop, on token ids.

Invariant: the target's cache holds the whole context except its last token,
`pending`. Each round feeds [pending, x_1..x_K] in one pass, which yields
p_1..p_{K+1} (the logits at `pending` judge x_1, and so on), then:

    verify -> emit x_1..x_n, y -> truncate the target cache to drop x_{n+1}..x_K
    -> y becomes the next `pending` (it has no K/V entry yet: the next round feeds it)

With K = 0 a round is one plain decode step, so plain autoregressive decoding (the
baseline and the tests' oracle) is this same loop without a drafter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from specdecode.backends.protocol import Model
from specdecode.core.probs import logits_to_probs, sample
from specdecode.core.verify import Randomness, verify
from specdecode.drafters.protocol import Drafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.stats import GenerationStats, RoundRecord

# where each emitted token came from
DRAFT, CORRECTION, BONUS, TARGET = "draft", "correction", "bonus", "target"


@dataclass(frozen=True, slots=True)
class Round:
    tokens: list[int]
    sources: list[str]  # DRAFT (accepted), CORRECTION (residual sample), BONUS, or TARGET (plain step)


def generate_tokens(target: Model, drafter: Drafter | None, prompt: Sequence[int], config: GenerationConfig,
                    eos_ids: frozenset[int], stats: GenerationStats | None = None) -> Iterator[Round]:
    """Yield the tokens of each round until EOS or max_new_tokens (never overshot)."""
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt) + 1 > target.max_length:
        raise ValueError(f"the prompt has {len(prompt)} tokens but {target.name} has a context of "
                         f"{target.max_length}: shorten the prompt")
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    params = config.sampling
    generator = torch.Generator().manual_seed(config.seed)
    k_max = config.k if drafter is not None else 0

    t0 = time.perf_counter()
    target.truncate(0)
    if drafter is not None:
        drafter.reset()
    if len(prompt) > 1:
        target.forward(prompt[:-1], n_logits=1)
    stats.t_prefill = time.perf_counter() - t0

    context = prompt
    produced = 0
    while produced < config.max_new_tokens:
        budget = config.max_new_tokens - produced
        room = target.max_length - target.length - 1  # positions left after `pending`
        if room < 0:
            return  # the context is full
        k = min(k_max, budget - 1, room)

        t0 = time.perf_counter()
        proposal = drafter.propose(context, k, params, generator) if k > 0 else None
        drafts = proposal.tokens[:k] if proposal else []
        t1 = time.perf_counter()

        logits = target.forward([context[-1]] + drafts, n_logits=len(drafts) + 1)
        p = logits_to_probs(logits, params)
        if drafts:
            q = None if proposal.q is None else proposal.q[: len(drafts)].to(p.dtype)
            rand = Randomness.draw(1, len(drafts), p.shape[-1], generator)
            result = verify(torch.tensor([drafts]), None if q is None else q[None], p[None], rand)
            n = int(result.n_accepted[0])
            emitted = result.emitted(0)
            sources = [DRAFT] * n + [BONUS if n == len(drafts) else CORRECTION]
            target.truncate(target.length - (len(drafts) - n))
            drafter.observe(len(drafts), n)
        else:
            n, emitted, sources = 0, [int(sample(p[0], generator))], [TARGET]
        t2 = time.perf_counter()

        for i, tok in enumerate(emitted):  # stop at EOS inside an accepted run
            if tok in eos_ids:
                emitted, sources = emitted[: i + 1], sources[: i + 1]
                break
        emitted, sources = emitted[:budget], sources[:budget]
        stats.add_round(RoundRecord(drafter=drafter.name if drafts else "none", drafted=len(drafts), accepted=n,
                                    emitted=len(emitted), t_draft=t1 - t0, t_verify=t2 - t1))
        context = context + emitted
        produced += len(emitted)
        if emitted[-1] in eos_ids:
            stats.finish_reason = "stop"
        yield Round(emitted, sources)
        if emitted[-1] in eos_ids:
            return
