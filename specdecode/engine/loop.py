"""The speculative decoding loop, on token ids.

Invariant: the target's cache holds the whole context except its last token,
`pending`. Each round feeds [pending, x_1..x_K] in one pass, which yields
p_1..p_{K+1} (the logits at `pending` judge x_1, and so on), then:

    verify -> emit x_1..x_n, y -> truncate the target cache to drop x_{n+1}..x_K
    -> y becomes the next `pending` (it has no K/V entry yet: the next round feeds it)

Drafters are tried in order (e.g. lookup, then the draft model); the first that
proposes something drafts this round, with K from the policy. A round with no
drafts is one plain decode step, so plain autoregressive decoding (the baseline
and the tests' oracle) is this same loop with no drafters.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from specdecode.backends.protocol import Model
from specdecode.core import VERIFY_RULES
from specdecode.core.probs import SamplingParams, logits_to_probs, sample
from specdecode.core.verify import Randomness, VerifyResult, verify
from specdecode.drafters.protocol import Drafter, Proposal
from specdecode.engine.config import GenerationConfig
from specdecode.engine.policy import AdaptiveK, FixedK, KPolicy
from specdecode.engine.stats import GenerationStats, RoundRecord

VerifyRule = Callable[..., VerifyResult]  # verify's signature: (draft_tokens, q, p, rand) -> VerifyResult

# where each emitted token came from
DRAFT, CORRECTION, BONUS, TARGET = "draft", "correction", "bonus", "target"


@dataclass(frozen=True, slots=True)
class Round:
    tokens: list[int]
    sources: list[str]  # DRAFT (accepted), CORRECTION (residual sample), BONUS, or TARGET (plain step)


def generate_tokens(target: Model, drafters: Sequence[Drafter], prompt: Sequence[int], config: GenerationConfig,
                    eos_ids: frozenset[int], stats: GenerationStats | None = None,
                    policy: KPolicy | None = None, rule: VerifyRule | None = None) -> Iterator[Round]:
    """Yield the tokens of each round until EOS or max_new_tokens (never overshot).

    policy: how many tokens to draft; default FixedK(config.k), or a fresh AdaptiveK when
    config.k is None (pass a long-lived AdaptiveK to keep what it learned across requests).
    rule: the verification rule; default the config's (`verification`); the audit passes its
    negative controls here.
    """
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt) + 1 > target.max_length:
        raise ValueError(f"the prompt has {len(prompt)} tokens but {target.name} has a context of "
                         f"{target.max_length}: shorten the prompt")
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt)
    if policy is None:
        policy = FixedK(config.k) if config.k is not None else AdaptiveK()
    params = config.sampling
    rule = rule if rule is not None else VERIFY_RULES[config.verification]
    generator = torch.Generator().manual_seed(config.seed)

    t0 = time.perf_counter()
    if drafters and policy.wants_calibration():
        calibrate(policy, target, drafters, prompt, params)
    prefill(target, drafters, prompt)
    policy.begin()
    stats.t_prefill = time.perf_counter() - t0

    context = prompt
    produced = 0
    owner = _claim(target)
    while produced < config.max_new_tokens:
        _check_owner(target, owner, context)
        budget = config.max_new_tokens - produced
        if target.length + 1 > target.max_length:
            return  # the context is full
        out = speculative_round(target, drafters, policy, context, budget - 1, params, generator, rule)
        # The policy learns from the whole verification, drafts after an EOS included: they were
        # drafted and judged by the target like any other, so they are honest evidence of the
        # acceptance rate and of the pass's cost (and the request ends with this round anyway).
        policy.observe(out.drafter, out.drafted, out.accepted, out.t_step * out.drafted, out.verified, out.t_verify)
        emitted, sources = out.tokens, out.sources
        for i, tok in enumerate(emitted):  # stop at EOS inside an accepted run
            if tok in eos_ids:
                emitted, sources = emitted[: i + 1], sources[: i + 1]
                break
        emitted, sources = emitted[:budget], sources[:budget]
        # The statistics describe the output: only drafts up to the EOS count as accepted and
        # tested (drafts past it are not in the output; counting them would skew alpha).
        accepted = min(out.accepted, len(emitted))
        stats.add_round(RoundRecord(drafter=out.drafter, drafted=out.drafted, accepted=accepted,
                                    emitted=len(emitted), t_draft=out.t_draft, t_verify=out.t_verify,
                                    verified=out.verified,
                                    tested=accepted if accepted < out.accepted else None))
        context = context + emitted
        produced += len(emitted)
        if emitted[-1] in eos_ids:
            stats.finish_reason = "stop"
        yield Round(emitted, sources)
        if emitted[-1] in eos_ids:
            return


# Which generation currently owns each target's cache (see _check_owner).
_OWNERS: "weakref.WeakKeyDictionary[Model, object]" = weakref.WeakKeyDictionary()


def _claim(target: Model) -> object:
    """Mark `target`'s cache as this generation's (a later generation on it takes over)."""
    owner = object()
    try:
        _OWNERS[target] = owner
    except TypeError:  # not weak-referenceable: the length check alone guards it
        pass
    return owner


def _check_owner(target: Model, owner: object, context: list[int]) -> None:
    """The loop's invariant (the cache holds context[:-1]) breaks when another generation used
    the same target in between, e.g. two `stream()` generators of one decoder advanced in turn.
    Detect it (ownership, and the cheap length check) instead of silently corrupting both."""
    if _OWNERS.get(target, owner) is not owner or target.length != len(context) - 1:
        raise RuntimeError(f"{target.name} is already generating another sequence (its cache no longer "
                           f"holds this generation's context): one decoder serves one generation at a "
                           f"time; use a decoder per concurrent stream")


def prefill(target: Model, drafters: Sequence[Drafter], prompt: Sequence[int]) -> int:
    """Start a sequence: empty caches, then the prompt minus its last token (the first `pending`)
    into the target. Returns the target's cache length, to restore the prefix later by truncating."""
    target.truncate(0)
    for d in drafters:
        d.reset()
    if len(prompt) > 1:
        target.forward(list(prompt[:-1]), n_logits=1)
    return target.length


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    tokens: list[int]  # x_1..x_n, y
    sources: list[str]
    drafter: str  # who proposed ("none": a plain step)
    drafted: int
    accepted: int
    verified: int  # tokens in the target pass (padding included)
    t_draft: float  # all drafting time of the round (catch-up included)
    t_verify: float
    t_step: float  # marginal time of one draft token, as the drafter measured it (else t_draft / drafted)


def speculative_round(target: Model, drafters: Sequence[Drafter], policy: KPolicy, context: list[int],
                      k_cap: int, params: SamplingParams, generator: torch.Generator,
                      rule: VerifyRule = verify) -> RoundOutcome:
    """One round. The target cache must hold context[:-1]; afterwards it holds (context + tokens)[:-1].

    k_cap bounds K (e.g. by the remaining token budget). `rule` is the verification rule
    (the audit swaps in broken ones to show it would catch them).
    """
    room = target.max_length - target.length - 1  # positions left after `pending`
    t0 = time.perf_counter()
    drafter, proposal = _draft(drafters, policy, context, min(k_cap, room), params, generator)
    t1 = time.perf_counter()
    drafts = proposal.tokens if proposal else []
    q = proposal.q if proposal else None

    size = min(policy.verify_size(len(drafts) + 1), room + 1) if drafts else 1
    padding = [drafts[-1]] * (size - len(drafts) - 1) if drafts else []  # ignored positions
    logits = target.forward([context[-1]] + drafts + padding, n_logits=size)[: len(drafts) + 1]
    p = logits_to_probs(logits, params)
    if drafts:
        # every tensor on p's device (q comes from the draft model's); the randomness is drawn
        # on the generator's device (CPU) and moved, so a seed's output does not depend on the device
        rand = Randomness.draw(1, len(drafts), p.shape[-1], generator, device=p.device)
        draft_tokens = torch.tensor([drafts], dtype=torch.long, device=p.device)
        result = rule(draft_tokens, None if q is None else q.to(device=p.device, dtype=p.dtype)[None], p[None], rand)
        n = int(result.n_accepted[0])
        emitted = result.emitted(0)
        sources = [DRAFT] * n + [BONUS if n == len(drafts) else CORRECTION]
        target.truncate(target.length - (size - 1 - n))  # keep pending + the n accepted drafts
        drafter.observe(len(drafts), n)
    else:
        n, emitted, sources = 0, [int(sample(p[0], generator, greedy=params.greedy))], [TARGET]
    t2 = time.perf_counter()
    t_step = 0.0
    if drafts:
        t_step = proposal.step_seconds if proposal.step_seconds is not None else (t1 - t0) / len(drafts)
    return RoundOutcome(emitted, sources, drafter.name if drafts else "none", len(drafts), n, size,
                        t1 - t0, t2 - t1, t_step)


def _draft(drafters: Sequence[Drafter], policy: KPolicy, context: list[int], k_cap: int,
           params: SamplingParams, generator: torch.Generator) -> tuple[Drafter | None, Proposal | None]:
    """Ask the drafters in order; the first non-empty proposal (cut to K) wins."""
    for drafter in drafters:
        lag = getattr(drafter, "lag", None)  # tokens a stateful drafter must catch up on first
        k = min(policy.choose(drafter.name, lag(context) if lag else 0), k_cap)
        if k < 1:
            continue
        proposal = drafter.propose(context, k, params, generator)
        if proposal.tokens:
            q = None if proposal.q is None else proposal.q[:k]
            return drafter, Proposal(proposal.tokens[:k], q, proposal.step_seconds)
    return None, None


def calibrate(policy: KPolicy, target: Model, drafters: Sequence[Drafter], prompt: Sequence[int],
              params: SamplingParams) -> None:
    """Measure the target's pass costs and each drafter's step cost after `prompt` (caches reset after)."""
    prompt = list(prompt)
    prefill(target, drafters, prompt)
    policy.calibrate(lambda n: time_pass(target, prompt[-1], n),
                     {d.name: (lambda d=d: _time_step(d, prompt, params)) for d in drafters},
                     {d.name: (lambda d=d: _time_catchup(d, prompt, params)) for d in drafters if hasattr(d, "lag")})


def _time_step(drafter: Drafter, prompt: list[int], params: SamplingParams) -> float | None:
    """A drafter's marginal time per drafted token, measured on the prompt (state reset after)."""
    t0 = time.perf_counter()
    proposal = drafter.propose(prompt, 3, params, torch.Generator().manual_seed(0))  # own RNG: no effect on output
    elapsed = time.perf_counter() - t0
    drafter.reset()
    if proposal.tokens and proposal.step_seconds is not None:
        return proposal.step_seconds
    return elapsed / max(1, len(proposal.tokens))  # e.g. lookup: the cost of looking


def _time_catchup(drafter: Drafter, prompt: list[int], params: SamplingParams, n: int = 16) -> float | None:
    """A stateful drafter's time per token to catch up on `n` tokens it has not seen (state reset after)."""
    context = list(prompt) + [prompt[-1]] * n  # the ids do not change the cost
    generator = torch.Generator().manual_seed(0)  # own RNG: no effect on output
    drafter.propose(context[:-n], 1, params, generator)  # in sync up to n tokens before the end
    t0 = time.perf_counter()
    proposal = drafter.propose(context, 1, params, generator)  # catch up on n - 1, then one draft step
    elapsed = time.perf_counter() - t0
    drafter.reset()
    if not proposal.tokens:
        return None  # e.g. the draft's context is too short for the measurement
    return max(0.0, elapsed - (proposal.step_seconds or 0.0)) / (n - 1)


def time_pass(target: Model, token: int, n: int) -> float | None:
    """Wall time of one target pass over n tokens, leaving the cache as it was (None: no room)."""
    length = target.length
    if length + n > target.max_length:
        return None
    t0 = time.perf_counter()
    target.forward([token] * n, n_logits=n)
    elapsed = time.perf_counter() - t0
    target.truncate(length)
    return elapsed
