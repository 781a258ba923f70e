"""One round for every running request: plan -> draft -> forward -> verify -> apply.

Invariant, per request: the target's cache holds the whole context except its last token,
`pending`. Each round feeds [pending, x_1..x_K] in one pass, which yields p_1..p_{K+1} (the
logits at `pending` judge x_1, and so on), then

    verify -> emit x_1..x_n, y -> truncate the target cache to drop x_{n+1}..x_K
    -> y becomes the next `pending` (it has no K/V entry yet: the next round feeds it)

A request's first round also feeds the rest of its prompt (`Request.unfed`) before `pending`, in
the same row: the pass that runs the prompt yields the first token, as in llama.cpp.

- plan: each row's drafter and K, row by row, against what the rows before it put into the pass.
  A free drafter proposes here (it costs nothing, and its proposal is what the later rows are
  weighed against); a draft model's steps wait for the next stage.
- draft: the draft models' steps of every row in lockstep (one pass of the draft per step), then
  each row's part of the pass (a tree cut to the alternatives that pay, padding to a cheaper size).
- forward: ONE target pass over every row (ragged), with the prompts' pieces a scheduler adds.
- verify: each row's logits into its accepted drafts and next token (engine/verification.py: the
  chains of one rule in one call, each row with its own randomness).
- apply: roll each cache back to its accepted tokens, tell the drafter and the K policy, cut at
  EOS and the budget, record the statistics.

A drafter may propose a tree (`Proposal.parents`): its row is [pending, nodes...] run with tree
attention (`forward_tree`), verified by the multi-candidate rule (core/tree.py), and the target
keeps the accepted path (`accept_path`) instead of truncating. Plain decoding (the baseline and the
tests' oracle) is a request with no drafters: the same round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from specdecode.backends.protocol import Row, forward_batch
from specdecode.core.probs import logits_to_probs
from specdecode.core.reproducible import CounterNoise, verify_equal
from specdecode.core.tree import DraftTree
from specdecode.core.verify import Randomness
from specdecode.drafters.model import draft_together
from specdecode.drafters.protocol import Drafter, Drafting, Proposal
from specdecode.engine.policy import ALONE, BatchLoad
from specdecode.engine.request import Request, State, VerifyRule
from specdecode.engine.stats import RoundRecord
from specdecode.engine.text import Chunk
from specdecode.engine.verification import plain_token, verify_chains, verify_tree_row

# where each emitted token came from (ALTERNATIVE: an accepted tree node off the drafter's chain)
DRAFT, ALTERNATIVE, CORRECTION, BONUS, TARGET = "draft", "alternative", "correction", "bonus", "target"


@dataclass(eq=False, slots=True)
class Plan:
    """One row of a round, filled in stage by stage."""

    request: Request
    load: BatchLoad = ALONE  # what the rows before it put into the pass (plan)
    drafter: Drafter | None = None  # who drafts (plan, draft)
    k: int = 0  # the chain's K (a tree's alternatives aside); while a draft model's steps wait, the planned K
    situation: Hashable = None  # the drafter's situation this round: its acceptance evidence's key
    shadow: tuple[str, int, Hashable] | None = None  # a free drafter given K = 0: (name, first token, situation)
    drafting: Drafting | None = None  # a draft model's steps, still to run with the other rows' (draft)
    rest: Sequence[Drafter] = ()  # the drafters after it, asked if it drafts nothing
    proposal: Proposal | None = None
    row: Row | None = None  # its part of the pass
    t_draft: float = 0.0
    logits: torch.Tensor | None = None  # forward
    drafted: int = 0  # verify: the chain's drafts (0: a plain step)
    accepted: int = 0  # verify: drafts accepted (a tree: its path's length)
    tokens: list[int] = field(default_factory=list)  # verify: x_1..x_n, y
    sources: list[str] = field(default_factory=list)  # DRAFT / ALTERNATIVE, CORRECTION, BONUS or TARGET
    path: list[int] | None = None  # verify, a tree: the accepted root-to-node path (node indices)
    tree_nodes: int = 0
    off_chain: bool = False  # a tree whose accepted path took an alternative branch


def run_round(requests: Sequence[Request], prefills: Sequence[Row] = ()) -> list[Chunk]:
    """One round for each request (none finished), in one target pass; each one's new tokens.

    prefills: pieces of prompts (rows whose logits nobody reads) run in the same pass: a scheduler's
    chunked prefill of requests not in `requests`. A request that ends (EOS, its budget, its context
    full) is FINISHED.

    A shared round without prompt tokens (pieces, or a row's rest) reports its cost (the pass and
    every row's verification) to the rows' policies (`observe_batch`), and each lockstep draft step
    its cost by the rows in it (`observe_draft_batch`): the batch's cost curves are measured where
    they are paid."""
    if any(r.finished for r in requests):
        raise ValueError("a round got a finished request: drop finished requests from the batch")
    if not requests:
        if prefills:
            forward_batch(prefills)
        return []
    shared = len(requests) > 1 or bool(prefills)  # other rows in the pass
    t0 = time.perf_counter()
    plans = plan(requests, shared)
    draft(plans, shared)
    t1 = time.perf_counter()
    pass_tokens = forward(plans, prefills)
    t_pass = time.perf_counter() - t1  # every row waited all of it
    verify(plans)
    if shared and not prefills and not any(r.unfed for r in requests):
        t_shared = time.perf_counter() - t1  # the pass and every row's verification
        for r in requests:  # what a shared round of these decoding tokens costs, for the next rounds' K
            r.policy.observe_batch(pass_tokens, t_shared, len(requests))
    t_round = time.perf_counter() - t0
    return [apply(p, t_pass, pass_tokens, t_round) for p in plans]


def plan(requests: Sequence[Request], shared: bool) -> list[Plan]:
    """Each row's drafter and K, against what the rows before it put into the pass.

    A draft model's row counts at its planned K until its steps have run. The prompts' pieces are
    not part of that load: their work is done whatever K is, so drafts are weighed against the
    decoding rows' pass (counted in, a 256-token piece made every draft look nearly free beside
    the pass's few emitted tokens). That prices a draft token beside a piece as beside the decoding
    rows alone: right where a pass's tokens cost about the same each, as on a CPU; on a flat GPU
    curve it overprices such drafts, never underprices them."""
    plans: list[Plan] = []
    tokens, expected, lockstep = 0, 0.0, ()
    for i, request in enumerate(requests):
        later = len(requests) - i - 1  # rows still to plan: one token each, for now
        p = Plan(request, BatchLoad(tokens + later, expected + later, lockstep) if shared else ALONE)
        t0 = time.perf_counter()
        _choose(p, request.drafters, defer=True)
        if p.drafting is None:
            _settle(p, shared)
        p.t_draft = time.perf_counter() - t0
        plans.append(p)
        # the decoding part (a tree's nodes, padding); not the prompt's rest: as beside a prompt's piece
        tokens += p.row.n_logits if p.row is not None else p.k + 1
        expected += request.policy.expected_tokens(p.drafter.name, p.k, p.situation) if p.k else 1.0
        if p.drafting is not None:
            lockstep += ((p.drafter.name, p.k),)
    return plans


def draft(plans: Sequence[Plan], shared: bool) -> None:
    """The draft models' steps of every waiting row in lockstep (each row samples from its own
    generator, so what it drafts does not depend on its batch); then each row's part of the pass."""
    waiting = [p for p in plans if p.drafting is not None]
    if not waiting:
        return
    t0 = time.perf_counter()
    steps: list[tuple[int, float]] = []
    proposals = draft_together([p.drafting for p in waiting], steps)
    t_together = time.perf_counter() - t0  # every row in it waited all of it
    if shared:  # what a lockstep draft step costs by its rows, for the next rounds' K
        for p in waiting:
            for rows, seconds in steps:
                p.request.policy.observe_draft_batch(p.drafter.name, rows, seconds, len(waiting))
    for p, proposal in zip(waiting, proposals):
        t1 = time.perf_counter()
        p.proposal, p.drafting = _within(proposal, p.k), None
        if not proposal.tokens and p.rest:  # nothing drafted: the next drafters, as `plan` would
            _choose(p, p.rest, defer=False)
        _settle(p, shared)
        p.t_draft += t_together + time.perf_counter() - t1


def forward(plans: Sequence[Plan], prefills: Sequence[Row]) -> int:
    """The round's one target pass (the prompts' pieces first); returns the tokens in it."""
    rows = [*prefills, *(p.row for p in plans)]
    for p, logits in zip(plans, forward_batch(rows)[len(prefills):]):
        p.logits = logits
    return sum(len(row.tokens) for row in rows)


def verify(plans: Sequence[Plan]) -> None:
    """Each row's accepted drafts and next token from its logits. Rows draw their randomness in
    order, each from its own generator; then the chains of each rule go to it in one call."""
    chains: dict[VerifyRule, list[tuple[Plan, torch.Tensor, Randomness]]] = {}
    for p in plans:
        r, drafts = p.request, p.proposal.tokens if p.proposal else []
        params, position = r.config.sampling, len(r.context)  # position: of the round's first new token
        if not drafts:  # a plain step
            token, p_1 = plain_token(p.logits[0], params, r.generator, position)
            if p.shadow is not None:  # p_1 judges the first new token whoever drafted: a one-hot x passes with p(x)
                name, guess, situation = p.shadow
                r.policy.observe_shadow(name, float(p_1[guess]) if p_1 is not None else float(guess == token),
                                        situation)
            p.tokens, p.sources = [token], [TARGET]
            continue
        probs = logits_to_probs(p.logits[: len(drafts) + 1], params)
        if p.shadow is not None:
            r.policy.observe_shadow(p.shadow[0], float(probs[0, p.shadow[1]]), p.shadow[2])
        if p.proposal.parents is not None:
            _verify_tree(p, probs)
        elif isinstance(r.generator, CounterNoise):  # reproducible: equality with the target's own choice
            _accept_chain(p, *verify_equal(drafts, probs, r.generator, position, params.greedy))
        else:
            chains.setdefault(r.rule, []).append((p, probs, Randomness.draw(1, len(drafts), r.generator, probs.device)))
    for rule, rows in chains.items():
        results = verify_chains(rule, [p.proposal.tokens for p, _, _ in rows], [p.proposal.q for p, _, _ in rows],
                                [probs for _, probs, _ in rows], [rand for _, _, rand in rows])
        for (p, _, _), (n, emitted) in zip(rows, results):
            _accept_chain(p, n, emitted)


def apply(p: Plan, t_pass: float, pass_tokens: int, t_round: float) -> Chunk:
    """Roll the row's cache back to what it accepted, let the drafter and the policy learn, then cut
    at EOS and the budget, record the round and the end."""
    r = p.request
    if p.path is not None:
        r.slot.target.accept_path([0] + [j + 1 for j in p.path])  # the root and the accepted path
    elif p.drafted:
        r.slot.target.truncate(r.slot.target.length - (p.row.n_logits - 1 - p.accepted))  # pending + the n accepted
    # the prompt's rest, if it rode in this row: its share of the pass, by tokens, is prefill
    share = t_pass * len(r.unfed) / pass_tokens
    name = _learn(p, t_pass - share, pass_tokens - len(r.unfed))
    r.stats.t_prefill += share
    r.unfed = []
    emitted, sources = p.tokens, p.sources
    for i, tok in enumerate(emitted):  # stop at EOS inside an accepted run
        if tok in r.eos_ids:
            emitted, sources = emitted[: i + 1], sources[: i + 1]
            break
    emitted, sources = emitted[:r.budget], sources[:r.budget]
    # The statistics describe the output: only drafts up to the EOS count as accepted and tested
    # (drafts past it are not in the output; counting them would skew alpha).
    accepted = min(p.accepted, len(emitted))
    r.stats.add_round(RoundRecord(drafter=name, drafted=p.drafted, accepted=accepted, emitted=len(emitted),
                                  t_draft=p.t_draft, t_verify=t_pass - share, verified=p.row.n_logits,
                                  tested=accepted if accepted < p.accepted else None, tree_nodes=p.tree_nodes,
                                  off_chain=p.off_chain, t_round=max(t_round - share, 0.0)))
    r.tokens += emitted
    if emitted[-1] in r.eos_ids:
        r.stats.finish_reason = "stop"
        r.state = State.FINISHED
    elif r.budget <= 0 or r.slot.target.length + 1 > r.slot.target.max_length:  # the context is full
        r.state = State.FINISHED
    return Chunk("", emitted, sources)


def _learn(p: Plan, t_verify: float, verified: int) -> str:
    """Tell the drafter and the K policy how the round went; the drafter's name ("none": a plain step).
    The policy learns from the whole verification, drafts after an EOS included: they were drafted and
    judged by the target like any other, so they are honest evidence of the acceptance rate and of the
    pass's cost (and the request ends with this round anyway)."""
    name, t_step = "none", 0.0
    if p.drafted:
        p.drafter.observe(p.drafted, p.accepted)
        name = p.drafter.name
        t_step = p.proposal.step_seconds if p.proposal.step_seconds is not None else p.t_draft / p.drafted
    p.request.policy.observe(name, p.drafted, p.accepted, t_step * p.drafted, verified, t_verify,
                             p.situation if p.drafted else None)
    return name


def _choose(p: Plan, drafters: Sequence[Drafter], defer: bool) -> None:
    """Ask the drafters in order; the first non-empty proposal (cut to K) wins. Also records the
    shadow: (name, token, situation) of the first free drafter given K = 0, with the token it would
    have drafted first (the policy learns its acceptance from the target's p at no cost). A drafter
    with a situation (prompt lookup: its match's length class) is given K for that situation.
    defer: a lockstep drafter's steps are not run but kept (`Plan.drafting`) for `draft`, with the
    drafters after it in case it drafts nothing."""
    r = p.request
    context, k_cap = r.context, min(r.budget - 1, _room(r))
    for n, drafter in enumerate(drafters):
        situation = drafter.situation(context)
        k = min(r.policy.choose(drafter.name, drafter.lag(context), p.load, situation), k_cap)
        if k < 1:
            if p.shadow is None and k_cap >= 1 and drafter.free:
                guess = drafter.continuation(context, (), 1)  # its chain's first token; no tree, no model
                p.shadow = (drafter.name, guess[0], situation) if guess else None
            continue
        if defer and drafter.lockstep:
            p.drafter, p.situation, p.k, p.rest = drafter, situation, k, drafters[n + 1:]
            p.drafting = drafter.drafting(context, k, r.config.sampling, r.generator)
            return
        proposal = drafter.propose(context, k, r.config.sampling, r.generator)
        if proposal.tokens:
            p.drafter, p.situation, p.proposal = drafter, situation, _within(proposal, k)
            return
    p.drafter, p.situation, p.proposal = None, None, None


def _within(proposal: Proposal, k: int) -> Proposal:
    """A chain cut to K tokens (a tree's chain is already within K)."""
    if proposal.parents is not None or len(proposal.tokens) <= k:
        return proposal
    return Proposal(proposal.tokens[:k], None if proposal.q is None else proposal.q[:k], proposal.step_seconds)


def _room(r: Request) -> int:
    """Positions left in the target's context after `pending`."""
    return r.slot.target.max_length - r.slot.target.length - len(r.unfed) - 1


def _settle(p: Plan, shared: bool) -> None:
    """With the proposal known: cut a tree to the alternatives that pay, and build the row."""
    r, proposal, room = p.request, p.proposal, _room(p.request)
    k = len(proposal.tokens) if proposal is not None else 0
    if proposal is not None and proposal.parents is not None:
        k = len(DraftTree(proposal.tokens, proposal.parents).main_chain())
    if proposal is not None and proposal.gains:  # a tree: the cost model decides how many alternatives pay
        gains = sorted(proposal.gains, reverse=True)
        # a row that feeds the prompt's rest first is a chain (a tree's attention starts at the cache)
        proposal = p.proposal = proposal.keep_alternatives(0 if r.unfed else
            min(r.policy.tree_alternatives(p.drafter.name, k, gains, p.load), room - k))
    p.k = k
    drafts, target = proposal.tokens if proposal else [], r.slot.target
    if proposal is not None and proposal.parents is not None:  # a tree: the root, then its nodes
        if r.unfed:
            raise RuntimeError(f"{p.drafter.name} proposed a tree with no gains for a row that feeds the "
                               f"prompt's rest: such a row must be a chain")
        p.row = Row(target, [r.context[-1]] + drafts, len(drafts) + 1, [-1] + [j + 1 for j in proposal.parents])
        return
    # padding to a cheaper pass size only pays when the row has the pass to itself (no prompt's rest either)
    size = 1 if not drafts else len(drafts) + 1 if shared or r.unfed else \
        min(r.policy.verify_size(len(drafts) + 1), room + 1)
    padding = [drafts[-1]] * (size - len(drafts) - 1) if drafts else []  # ignored positions
    p.row = Row(target, [*r.unfed, r.context[-1]] + drafts + padding, size)


def _accept_chain(p: Plan, n: int, emitted: list[int]) -> None:
    p.drafted, p.accepted, p.tokens = len(p.proposal.tokens), n, emitted
    p.sources = [DRAFT] * n + [BONUS if n == p.drafted else CORRECTION]


def _verify_tree(p: Plan, probs: torch.Tensor) -> None:
    """A tree row: the multi-candidate walk (or reproducible equality). The policy hears of the chain
    (nodes 0..K-1 by construction of the drafters' trees): its K and how far the accepted path
    followed it."""
    r, proposal = p.request, p.proposal
    tree = DraftTree(proposal.tokens, proposal.parents, proposal.q)
    p.path, p.tokens = verify_tree_row(r.rule, tree, probs, r.generator, len(r.context), r.config.sampling.greedy)
    chain = set(tree.main_chain())
    p.drafted, p.accepted, p.tree_nodes = len(chain), len(p.path), len(tree)
    p.off_chain = bool(set(p.path) - chain)
    p.sources = [DRAFT if j in chain else ALTERNATIVE for j in p.path] + \
        [BONUS if not tree.children(p.path[-1] if p.path else -1) else CORRECTION]
