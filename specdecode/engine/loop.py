"""The speculative decoding loop, on token ids, for a batch of sequences.

Invariant, per sequence: the target's cache holds the whole context except its last
token, `pending`. Each round feeds [pending, x_1..x_K] in one pass, which yields
p_1..p_{K+1} (the logits at `pending` judge x_1, and so on), then:

    verify -> emit x_1..x_n, y -> truncate the target cache to drop x_{n+1}..x_K
    -> y becomes the next `pending` (it has no K/V entry yet: the next round feeds it)

A sequence's first round also feeds the prompt's rest (`Sequence.unfed`: the prompt but its
last token, less what a prefix cache held or a scheduler's pieces ran) before `pending`, in the
same row: the pass that runs the prompt yields the first token, as in llama.cpp. Until then the
cache holds context[:-1-len(unfed)].

`step(batch)` does one round for every running sequence: each drafts on its own
(drafters tried in order, e.g. lookup then the draft model; the first that proposes
something drafts, with K from the sequence's policy given what the rest of the batch
puts into the pass), then ONE target pass over every sequence's row (ragged; a row
with no drafts is a plain decode step), then each row is verified with randomness
from the sequence's own generator and truncated on its own. Single-request
generation is `step` over a batch of one, and plain autoregressive decoding (the
baseline and the tests' oracle) is a sequence with no drafters: one loop.

A drafter may propose a tree (`Proposal.parents`): its row is [pending, nodes...] run with
tree attention (`forward_tree`), verified by the multi-candidate rule (core/tree.py), and the
target keeps the accepted path (`accept_path`) instead of truncating.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence as Seq

import torch

from specdecode.backends.protocol import Model, Row, common_prefix, forward_batch
from specdecode.checks import SettingError
from specdecode.core import VERIFY_RULES
from specdecode.core.probs import SamplingParams, greedy_token, logits_to_probs
from specdecode.core.reproducible import CounterNoise, sample_token, verify_equal, verify_tree_equal
from specdecode.core.tree import DraftTree
from specdecode.core.verify import Randomness, verify
from specdecode.drafters.model import Drafting, draft_together
from specdecode.drafters.protocol import Drafter, Proposal
from specdecode.engine.config import GenerationConfig
from specdecode.engine.policy import ALONE, AdaptiveK, BatchLoad, FixedK, KPolicy
from specdecode.engine.sequence import Sequence, Slot, VerifyRule
from specdecode.engine.stats import GenerationStats, RoundRecord

# where each emitted token came from (ALTERNATIVE: an accepted tree node off the drafter's chain)
DRAFT, ALTERNATIVE, CORRECTION, BONUS, TARGET = "draft", "alternative", "correction", "bonus", "target"


@dataclass(frozen=True, slots=True)
class Round:
    tokens: list[int]
    sources: list[str]  # DRAFT / ALTERNATIVE (accepted), CORRECTION (residual sample), BONUS, or TARGET (plain step)


def new_sequence(slot: Slot, prompt: Seq[int], config: GenerationConfig, eos_ids: frozenset[int],
                 stats: GenerationStats | None = None, policy: KPolicy | None = None,
                 rule: VerifyRule | None = None, speculative: bool = True) -> Sequence:
    """A request's state, checked (the prompt must fit the target's context).

    policy: how many tokens to draft; default FixedK(config.k), or a fresh AdaptiveK when
    config.k is None (pass an AdaptiveK's `for_request()` to use costs it measured).
    rule: the verification rule; default the config's (`verification`); the audit passes its
    negative controls here.
    """
    prompt = list(prompt)
    target = slot.target
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt) + 1 > target.max_length:
        setting = target.context_setting  # what sets the context, if the user can
        raise SettingError(f"the prompt has {len(prompt)} tokens but {target.name} has a context of "
                           f"{target.max_length} (the prompt and one new token at least must fit): shorten the "
                           f"prompt" + (f" or raise {{{setting}}}" if setting else ""))
    if policy is None:
        policy = FixedK(config.k) if config.k is not None else AdaptiveK()
    rule = rule if rule is not None else VERIFY_RULES[config.verification]
    source = CounterNoise(config.seed) if config.reproducible else torch.Generator().manual_seed(config.seed)
    return Sequence(prompt, config, slot, policy, rule, source, eos_ids,
                    stats if stats is not None else GenerationStats(), speculative)


def start(seq: Sequence, cached: Seq[int] = ()) -> None:
    """Put the sequence into its slot (calibrating an uncalibrated adaptive policy first), leaving the
    prompt's rest for its first round (`seq.unfed`).

    cached: the token ids whose K/V the slot's target holds from its last request (a prefix
    cache): the prompt's longest common prefix with them is kept, not recomputed. The rest, but the
    last token, goes into `seq.unfed`: the first `step` runs it in the pass that yields the first
    token (one pass, as llama.cpp's generate and server do, not a prompt pass and then a one-token
    step: that cost a pass, ~1% of a 128-token request). A scheduler may run it in pieces first
    (`step`'s prefills), taking them from `seq.unfed`."""
    seq.stats.prompt_tokens = len(seq.prompt)
    t0 = time.perf_counter()
    if seq.drafters and seq.policy.wants_calibration():
        calibrate(seq.policy, seq.slot.target, seq.drafters, seq.prompt, seq.config.sampling)
        cached = seq.prompt[:-1]  # what the calibration left in the cache
    seq.stats.cached_tokens = keep = common_prefix(cached, seq.prompt[:-1])
    prefill(seq.slot.target, seq.slot.drafters, seq.prompt, keep, run=False)
    seq.unfed = seq.prompt[keep:-1]
    seq.policy.begin()
    _claim(seq)
    seq.stats.t_prefill = time.perf_counter() - t0


def generate_tokens(target: Model, drafters: Seq[Drafter], prompt: Seq[int], config: GenerationConfig,
                    eos_ids: frozenset[int], stats: GenerationStats | None = None,
                    policy: KPolicy | None = None, rule: VerifyRule | None = None) -> Iterator[Round]:
    """Yield the tokens of each round until EOS or max_new_tokens (never overshot): a batch of one.
    (The prompt is checked here, before the first round.)"""
    return run(new_sequence(Slot(target, tuple(drafters)), prompt, config, eos_ids, stats, policy, rule))


def run(seq: Sequence) -> Iterator[Round]:
    """Generate one sequence to its end: start it, then `step` it alone."""
    start(seq)
    while not seq.finished:
        yield step([seq])[0]


def step(batch: Seq[Sequence], prefills: Seq[Row] = ()) -> list[Round]:
    """One round for each sequence of `batch` (none may be finished), in one target pass.

    Returns each sequence's new tokens, in order; a sequence that ends (EOS, its token budget,
    its context full) is marked finished and its slot may take another request.
    A sequence with `unfed` prompt tokens (its first round) feeds them in its row before `pending`
    (a chain's row; no tree).
    prefills: pieces of prompts (rows whose logits nobody reads) run in the same pass: a scheduler's
    chunked prefill of sequences not in `batch` (their tokens taken from `unfed`).
    """
    if not batch:
        if prefills:
            forward_batch(prefills)
        return []
    if any(seq.finished for seq in batch):
        raise ValueError("step() got a finished sequence: drop finished sequences from the batch")
    for seq in batch:
        _check_owner(seq)
    jobs = [RoundJob(seq.slot.target, seq.drafters, seq.policy, seq.context, seq.budget - 1,
                     seq.config.sampling, seq.generator, seq.rule, seq.unfed) for seq in batch]
    t0 = time.perf_counter()
    outcomes = speculative_rounds(jobs, prefills)
    t_round = time.perf_counter() - t0  # every sequence of the batch waited all of it
    return [_emit(seq, out, t_round) for seq, out in zip(batch, outcomes)]


def _emit(seq: Sequence, out: "RoundOutcome", t_round: float) -> Round:
    """Apply one round's outcome to its sequence: EOS and budget cuts, statistics, the end."""
    # The policy learns from the whole verification, drafts after an EOS included: they were
    # drafted and judged by the target like any other, so they are honest evidence of the
    # acceptance rate and of the pass's cost (and the request ends with this round anyway).
    # the prompt's rest, if it rode in this round's row: its share of the pass, by tokens, is prefill
    share = out.t_verify * len(seq.unfed) / out.pass_tokens
    t_verify = out.t_verify - share
    seq.policy.observe(out.drafter, out.drafted, out.accepted, out.t_step * out.drafted,
                       out.pass_tokens - len(seq.unfed), t_verify, out.situation)
    seq.stats.t_prefill += share
    seq.unfed = []
    emitted, sources = out.tokens, out.sources
    for i, tok in enumerate(emitted):  # stop at EOS inside an accepted run
        if tok in seq.eos_ids:
            emitted, sources = emitted[: i + 1], sources[: i + 1]
            break
    emitted, sources = emitted[:seq.budget], sources[:seq.budget]
    # The statistics describe the output: only drafts up to the EOS count as accepted and
    # tested (drafts past it are not in the output; counting them would skew alpha).
    accepted = min(out.accepted, len(emitted))
    seq.stats.add_round(RoundRecord(drafter=out.drafter, drafted=out.drafted, accepted=accepted,
                                    emitted=len(emitted), t_draft=out.t_draft, t_verify=t_verify,
                                    verified=out.verified, tested=accepted if accepted < out.accepted else None,
                                    tree_nodes=out.tree_nodes, off_chain=out.off_chain,
                                    t_round=max(t_round - share, 0.0)))
    seq.tokens += emitted
    target = seq.slot.target
    if emitted[-1] in seq.eos_ids:
        seq.stats.finish_reason = "stop"
        seq.finished = True
    elif seq.budget <= 0 or target.length + 1 > target.max_length:  # the context is full
        seq.finished = True
    return Round(emitted, sources)


def _claim(seq: Sequence) -> None:
    """Mark the slot's target cache as this sequence's (a later sequence in the slot takes over)."""
    try:
        seq.slot.target.owner = seq  # type: ignore[attr-defined]
    except AttributeError:  # a model that takes no attributes: the length check alone guards it
        pass


def _check_owner(seq: Sequence) -> None:
    """The loop's invariant (the cache holds context[:-1]) breaks when another generation used
    the same target in between, e.g. two `stream()` generators of one decoder advanced in turn.
    Detect it (ownership, and the cheap length check) instead of silently corrupting both."""
    target = seq.slot.target
    if getattr(target, "owner", seq) is not seq or \
            target.length + len(seq.unfed) != len(seq.prompt) + len(seq.tokens) - 1:
        raise RuntimeError(f"{target.name} is already generating another sequence (its cache no longer "
                           f"holds this generation's context): one decoder serves one generation at a "
                           f"time; use a decoder per concurrent stream, or generate_many for a batch")


def prefill(target: Model, drafters: Seq[Drafter], prompt: Seq[int], keep: int = 0, run: bool = True) -> int:
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


@dataclass(frozen=True, slots=True)
class RoundJob:
    """What one row of a round needs (a running sequence's, or the audit's)."""

    target: Model
    drafters: Seq[Drafter]
    policy: KPolicy
    context: list[int]
    k_cap: int  # bounds K (e.g. by the remaining token budget)
    params: SamplingParams
    generator: torch.Generator
    rule: VerifyRule = verify
    unfed: Seq[int] = ()  # prompt tokens to feed before `pending` (the cache holds context[:-1-len(unfed)])


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    tokens: list[int]  # x_1..x_n, y
    sources: list[str]
    drafter: str  # who proposed ("none": a plain step)
    drafted: int
    accepted: int
    verified: int  # tokens verified in the target pass for this row (padding included; the prompt's rest not)
    t_draft: float  # all drafting time of the round (catch-up included)
    t_verify: float  # the whole pass (shared by the batch's rows)
    t_step: float  # marginal time of one draft token, as the drafter measured it (else t_draft / drafted)
    pass_tokens: int  # tokens in the whole pass (all rows): what t_verify paid for
    tree_nodes: int = 0  # a tree round: the tree's drafted nodes (drafted counts its chain only)
    off_chain: bool = False  # a tree round whose accepted path took an alternative branch
    situation: Hashable = None  # the drafter's situation (policy.py: acceptance is learned per situation)


def speculative_round(target: Model, drafters: Seq[Drafter], policy: KPolicy, context: list[int],
                      k_cap: int, params: SamplingParams, generator: torch.Generator,
                      rule: VerifyRule = verify) -> RoundOutcome:
    """One round of one sequence (a batch of one). The target cache must hold context[:-1];
    afterwards it holds (context + tokens)[:-1]. `rule` is the verification rule (the audit
    swaps in broken ones to show it would catch them)."""
    return speculative_rounds([RoundJob(target, drafters, policy, context, k_cap, params, generator, rule)])[0]


def speculative_rounds(jobs: Seq[RoundJob], prefills: Seq[Row] = ()) -> list[RoundOutcome]:
    """One round for each job: each drafts, one pass verifies them all (with `prefills`, rows of
    prompts whose logits nobody reads), each is verified alone.

    K is chosen row by row, each row against what the rows before it put into the pass. A draft
    model's steps are deferred and run for all rows together (`draft_together`: one pass per
    step), so until they have run a later row counts such a row at its planned K.

    The prompts' pieces are not part of that load: their work is done whatever K is, so drafts
    are weighed against the decoding rows' pass. (Counted in, a 256-token piece made every draft
    look nearly free against the pass's tiny rate of emitted tokens: at 8 clients rows drafted
    0.49 tokens each and the server ran at 0.85x of itself with speculation off.) This prices a
    draft token beside a piece as beside the decoding rows alone: right where a pass's tokens
    cost about the same each, as on a CPU; on a flat GPU curve it overprices such drafts, never
    underprices them.

    A shared round without prompt tokens (pieces, or a row's rest) reports its cost (the pass and
    every row's verification) to the rows' policies (`observe_batch`), and each lockstep draft step
    its cost by the rows in it (`observe_draft_batch`): the batch's cost curves are measured where
    they are paid."""
    tokens, expected, lockstep = 0, 0.0, ()
    shared = len(jobs) > 1 or bool(prefills)  # other rows in the pass
    prompts = bool(prefills) or any(job.unfed for job in jobs)  # prompt tokens in it (pieces, or a row's rest)
    plans: list[_Draft] = []
    for i, job in enumerate(jobs):
        later = len(jobs) - i - 1  # rows still to draft: one token each, for now
        load = BatchLoad(tokens + later, expected + later, lockstep) if shared else ALONE
        t0 = time.perf_counter()
        plan = _draft(job.drafters, job.policy, job.context, min(job.k_cap, _room(job)), job.params,
                      job.generator, load, defer=True)
        if plan.drafting is None:
            _settle(job, plan, shared)
        plan.t_draft = time.perf_counter() - t0
        plans.append(plan)
        # the decoding part (a tree's nodes, padding); not the prompt's rest: as beside a prompt's piece
        tokens += plan.row.n_logits if plan.row is not None else plan.k + 1
        expected += job.policy.expected_tokens(plan.drafter.name, plan.k, plan.situation) if plan.k else 1.0
        if plan.drafting is not None:
            lockstep += ((plan.drafter.name, plan.k),)
    deferred = [(job, plan) for job, plan in zip(jobs, plans) if plan.drafting is not None]
    if deferred:
        t0 = time.perf_counter()
        steps: list[tuple[int, float]] = []
        proposals = draft_together([plan.drafting for _, plan in deferred], steps)
        t_together = time.perf_counter() - t0  # every row in it waited all of it
        if shared:  # what a lockstep draft step costs by its rows, for the next rounds' K
            for job, plan in deferred:
                for rows, seconds in steps:
                    job.policy.observe_draft_batch(plan.drafter.name, rows, seconds, len(deferred))
        for (job, plan), proposal in zip(deferred, proposals):
            t1 = time.perf_counter()
            plan.proposal, plan.drafting = _within(proposal, plan.k), None
            if not proposal.tokens and plan.rest:  # nothing drafted: the next drafters, as `_draft` would
                again = _draft(plan.rest, job.policy, job.context, min(job.k_cap, _room(job)), job.params,
                               job.generator, plan.load)
                plan.drafter, plan.proposal, plan.shadow = again.drafter, again.proposal, plan.shadow or again.shadow
                plan.situation = again.situation
            _settle(job, plan, shared)
            plan.t_draft += t_together + time.perf_counter() - t1
    rows = list(prefills) + [plan.row for plan in plans]
    t1 = time.perf_counter()
    logits_of = forward_batch(rows)[len(prefills):]
    t_pass = time.perf_counter() - t1
    pass_tokens = sum(len(row.tokens) for row in rows)  # the prompts' pieces included: t_pass paid for them
    outcomes = [_verify_row(job, plan.drafter, plan.proposal, logits, plan.t_draft, t_pass, plan.row.n_logits,
                            pass_tokens, plan.shadow, plan.situation)
                for job, plan, logits in zip(jobs, plans, logits_of)]
    if shared and not prompts:  # what a shared round of these decoding tokens costs, for the next rounds' K
        t_round = time.perf_counter() - t1
        for job in jobs:
            job.policy.observe_batch(pass_tokens, t_round, len(jobs))
    return outcomes


@dataclass(slots=True)
class _Draft:
    """One row's drafting in a round: who drafted what, and the row it puts into the pass."""

    drafter: Drafter | None
    proposal: Proposal | None
    shadow: tuple[str, int, Hashable] | None  # a free drafter given K = 0: its first token, situation (`_draft`)
    load: BatchLoad = ALONE  # what the rows before it put into the pass
    situation: Hashable = None  # the drafter's situation this round (its acceptance evidence's key)
    drafting: Drafting | None = None  # a draft model's steps, still to run with the other rows' (planned K)
    rest: Seq[Drafter] = ()  # the drafters after it, asked if it drafts nothing
    k: int = 0  # the chain's K (a tree's alternatives aside); while deferred, the planned K
    row: Row | None = None
    t_draft: float = 0.0


def _room(job: RoundJob) -> int:
    return job.target.max_length - job.target.length - len(job.unfed) - 1  # positions left after `pending`


def _settle(job: RoundJob, plan: _Draft, shared: bool) -> None:
    """With the proposal known: cut a tree to the alternatives that pay, and build the row."""
    proposal, room = plan.proposal, _room(job)
    k = len(proposal.tokens) if proposal is not None else 0
    if proposal is not None and proposal.parents is not None:
        k = len(DraftTree(proposal.tokens, proposal.parents).main_chain())
    if proposal is not None and proposal.gains:  # a tree: the cost model decides how many alternatives pay
        gains = sorted(proposal.gains, reverse=True)
        # a row that feeds the prompt's rest first is a chain (a tree's attention starts at the cache)
        proposal = plan.proposal = proposal.keep_alternatives(0 if job.unfed else
            min(job.policy.tree_alternatives(plan.drafter.name, k, gains, plan.load), room - k))
    plan.k = k
    drafts = proposal.tokens if proposal else []
    if proposal is not None and proposal.parents is not None:  # a tree: the root, then its nodes
        if job.unfed:
            raise RuntimeError(f"{plan.drafter.name} proposed a tree with no gains for a row that feeds the "
                               f"prompt's rest: such a row must be a chain")
        size = len(drafts) + 1
        plan.row = Row(job.target, [job.context[-1]] + drafts, size, [-1] + [p + 1 for p in proposal.parents])
        return
    # padding to a cheaper pass size only pays when the row has the pass to itself (no prompt's rest either)
    size = 1 if not drafts else len(drafts) + 1 if shared or job.unfed else \
        min(job.policy.verify_size(len(drafts) + 1), room + 1)
    padding = [drafts[-1]] * (size - len(drafts) - 1) if drafts else []  # ignored positions
    plan.row = Row(job.target, [*job.unfed, job.context[-1]] + drafts + padding, size)


def _verify_row(job: RoundJob, drafter: Drafter | None, proposal: Proposal | None, logits: torch.Tensor,
                t_draft: float, t_pass: float, size: int, pass_tokens: int,
                shadow: tuple[str, int, Hashable] | None = None, situation: Hashable = None) -> RoundOutcome:
    """size: the row's positions from `pending` on (the logits; the prompt's rest before them aside)."""
    drafts = proposal.tokens if proposal else []
    position = len(job.context)  # of the round's first new token, in the whole sequence
    if not drafts:  # a plain step
        token, p0 = _plain_step(logits[0], job.params, job.generator, position)
        if shadow is not None:  # p_1 judges the first new token whoever drafted: a one-hot x passes with p(x)
            job.policy.observe_shadow(shadow[0], float(p0[shadow[1]]) if p0 is not None else
                                      float(shadow[1] == token), shadow[2])
        return RoundOutcome([token], [TARGET], "none", 0, 0, size, t_draft, t_pass, 0.0, pass_tokens)
    p = logits_to_probs(logits[: len(drafts) + 1], job.params)
    if shadow is not None:
        job.policy.observe_shadow(shadow[0], float(p[0, shadow[1]]), shadow[2])
    if proposal is not None and proposal.parents is not None:
        return _verify_tree_row(job, drafter, proposal, p, t_draft, t_pass, size, pass_tokens)
    if isinstance(job.generator, CounterNoise):
        n, emitted = verify_equal(drafts, p, job.generator, position, job.params.greedy)  # reproducible
    else:
        n, emitted = _judge(drafts, proposal.q, p, job.rule, job.generator)
    sources = [DRAFT] * n + [BONUS if n == len(drafts) else CORRECTION]
    job.target.truncate(job.target.length - (size - 1 - n))  # keep pending + the n accepted drafts
    drafter.observe(len(drafts), n)
    t_step = proposal.step_seconds if proposal.step_seconds is not None else t_draft / len(drafts)
    return RoundOutcome(emitted, sources, drafter.name, len(drafts), n, size, t_draft, t_pass, t_step, pass_tokens,
                        situation=situation)


def _plain_step(logits: torch.Tensor, params: SamplingParams, source: "torch.Generator | CounterNoise",
                position: int) -> tuple[int, torch.Tensor | None]:
    """A plain step's token from p_1's logits [V], and p_1 (None when greedy: it would be one-hot at
    the token, and building it cost ~0.3 ms a token, 1% of a step beside llama.cpp)."""
    if params.greedy:
        return greedy_token(logits), None
    p = logits_to_probs(logits, params)
    return sample_token(p, source, position, False), p


def _judge(drafts: list[int], q: torch.Tensor | None, p: torch.Tensor, rule: VerifyRule,
           generator: torch.Generator) -> tuple[int, list[int]]:
    """A chain's verification: (drafts accepted, tokens emitted)."""
    # every tensor on p's device (q comes from the draft model's); the randomness is drawn
    # on the sequence's generator (CPU) and moved, so a seed's output depends neither on
    # the device nor on the other rows of the batch
    rand = Randomness.draw(1, len(drafts), generator, device=p.device)
    draft_tokens = torch.tensor([drafts], dtype=torch.long, device=p.device)
    result = rule(draft_tokens, None if q is None else q.to(device=p.device, dtype=p.dtype)[None], p[None], rand)
    return int(result.n_accepted[0]), result.emitted(0)


def _verify_tree_row(job: RoundJob, drafter: Drafter, proposal: Proposal, p: torch.Tensor, t_draft: float,
                     t_pass: float, size: int, pass_tokens: int) -> RoundOutcome:
    """A tree row: the multi-candidate walk (or reproducible equality), then the target keeps the
    root and the accepted path. The policy hears of the chain (nodes 0..K-1 by construction of
    the drafters' trees): its K and how far the accepted path followed it."""
    tree = DraftTree(proposal.tokens, proposal.parents, proposal.q)
    if isinstance(job.generator, CounterNoise):
        path, emitted = verify_tree_equal(tree, p, job.generator, len(job.context), job.params.greedy)
    else:
        rand = Randomness.draw(1, len(tree), job.generator, device=p.device)
        tree = DraftTree(tree.tokens, tree.parents, None if tree.q is None else tree.q.to(p.device))
        # the multi-candidate rule, whichever chain rule the job has (block verification is a chain
        # rule); the audit's broken controls bring their own tree versions
        result = job.rule.tree_rule(tree, p, rand.u[0], rand.v[0])
        path, emitted = result.path, result.tokens
    job.target.accept_path([0] + [j + 1 for j in path])
    chain = tree.main_chain()
    n = len(path)
    drafter.observe(len(chain), n)
    on_chain = set(chain)
    sources = [DRAFT if j in on_chain else ALTERNATIVE for j in path] + \
        [BONUS if not tree.children(path[-1] if path else -1) else CORRECTION]
    t_step = proposal.step_seconds if proposal.step_seconds is not None else t_draft / len(chain)
    return RoundOutcome(emitted, sources, drafter.name, len(chain), n, size, t_draft, t_pass, t_step, pass_tokens,
                        tree_nodes=len(tree), off_chain=bool(set(path) - on_chain))


def _draft(drafters: Seq[Drafter], policy: KPolicy, context: list[int], k_cap: int, params: SamplingParams,
           generator: torch.Generator, load: BatchLoad = ALONE, defer: bool = False) -> _Draft:
    """Ask the drafters in order; the first non-empty proposal (cut to K) wins. Also gives the
    shadow: (name, token, situation) of the first free drafter given K = 0, with the token it would
    have drafted first (the policy learns its acceptance from the target's p at no cost). A drafter
    with a `situation` (prompt lookup: its match's length class) is given K for that situation.
    defer: a draft model's steps are not run but returned (`_Draft.drafting`) for
    `draft_together`, with the drafters after it in case it drafts nothing."""
    shadow = None
    for n, drafter in enumerate(drafters):
        situation = drafter.situation(context)
        k = min(policy.choose(drafter.name, drafter.lag(context), load, situation), k_cap)
        if k < 1:
            if shadow is None and k_cap >= 1 and drafter.free:
                guess = drafter.continuation(context, (), 1)  # its chain's first token; no tree, no model
                shadow = (drafter.name, guess[0], situation) if guess else None
            continue
        if defer and drafter.lockstep:
            return _Draft(drafter, None, shadow, load, situation, drafter.drafting(context, k, params, generator),
                          drafters[n + 1:], k)
        proposal = drafter.propose(context, k, params, generator)
        if proposal.tokens:
            return _Draft(drafter, _within(proposal, k), shadow, load, situation)
    return _Draft(None, None, shadow, load)


def _within(proposal: Proposal, k: int) -> Proposal:
    """A chain cut to K tokens (a tree's chain is already within K)."""
    if proposal.parents is not None or len(proposal.tokens) <= k:
        return proposal
    return Proposal(proposal.tokens[:k], None if proposal.q is None else proposal.q[:k], proposal.step_seconds)


def calibrate(policy: KPolicy, target: Model, drafters: Seq[Drafter], prompt: Seq[int],
              params: SamplingParams) -> None:
    """Measure the cost of a round of each size (the target's pass and the work on its logits, with
    `params`) and each drafter's step cost after `prompt` (caches reset after)."""
    prompt = list(prompt)
    prefill(target, drafters, prompt)
    policy.calibrate(lambda n: time_pass(target, prompt[-1], n, params),
                     {d.name: (lambda d=d: _time_step(d, prompt, params)) for d in drafters},
                     {d.name: (lambda d=d: _time_catchup(d, prompt, params)) for d in drafters if d.lockstep})


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


def time_pass(target: Model, token: int, n: int, params: SamplingParams | None = None) -> float | None:
    """Wall time of one target pass over n tokens, leaving the cache as it was (None: no room).

    params: also time what a round does with the pass's logits, as `_verify_row` does it: a plain
    step's token (n = 1), or the probabilities of every row and the verification of n - 1
    one-hot drafts (the residual, its float64 cumulative sum and the accept tests: ~1 ms for
    Qwen's 151,936 tokens): what adaptive K must weigh, since on a CPU it is part of a
    round that drafts (README, "Speculation against plain, pair by pair"). The calibrating request's
    sampling prices every later request's rounds (as it prices the drafters' steps): a sampled
    round's probabilities cost ~2 ms more than a greedy one's for 4 rows of 151,936."""
    length = target.length
    if length + n > target.max_length:
        return None
    t0 = time.perf_counter()
    logits = target.forward([token] * n, n_logits=n)
    if params is not None:
        generator = torch.Generator().manual_seed(0)  # its own: no effect on any output
        if n > 1:
            _judge([token] * (n - 1), None, logits_to_probs(logits, params), verify, generator)
        else:
            _plain_step(logits[0], params, generator, length)
    elapsed = time.perf_counter() - t0
    target.truncate(length)
    return elapsed
