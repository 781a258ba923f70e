"""The draft model's tree with copies: a free drafter's continuations of the chain's paths as branches.

What the multi-candidate rule needs from the drafter (core/tree.py), checked on the proposal:
each copy is what the branch source continues the path above it with, hung where it leaves the
chain; its nodes are deterministic (one-hot q); the alternatives of a depth never repeat its
copy's head nor the chain's token, and each one's q is the pool it was drawn from (without the
chain's token, the copy's head and the earlier alternatives); and every kept subset the cost
model may choose keeps each node's parent. (The law itself: tests/engine/test_tree.py.)
"""

from __future__ import annotations

import pytest
import torch

from specdecode.core.probs import SamplingParams
from specdecode.core.tree import DraftTree
from specdecode.drafters.lookup import LookupConfig, LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
from tests.tiny import tiny_pair

V = 8
# repeats, so prompt lookup continues the chain's paths: after (1, 2) comes 3, after (2, 3) comes 4, ...
CONTEXT = [1, 2, 3, 4, 5, 1, 2, 3, 6, 1, 2]


def proposals(params: SamplingParams, source, seeds: int = 40, k: int = 4, tree: int = 40):
    """(tree 40 keeps every slot: a copy's gain, the draft's probability of its head, is low with this
    poor draft, and a small tree would rarely hold one; keep_alternatives below checks the cuts)"""
    _, draft = tiny_pair(vocab=V, seed=11, noise=0.8, scale=0.15)  # a poor draft: it leaves the copy often
    drafter = ModelDrafter(draft, tree=tree, min_gain=0.0, branches=source)
    for seed in range(seeds):
        drafter.reset()
        yield drafter.propose(CONTEXT, k, params, torch.Generator().manual_seed(seed)), drafter


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.0)], ids=["sampled", "greedy"])
@pytest.mark.parametrize("make_source", [lambda: LookupDrafter(LookupConfig(min_n=1, max_n=3)),
                                         lambda: SuffixDrafter(SuffixConfig(min_n=1, max_n=3, min_score=0.1))],
                         ids=["lookup", "suffix"])
def test_copies_are_the_sources_continuations_and_alternatives_avoid_them(params, make_source):
    source = make_source()
    copies = 0
    for proposal, drafter in proposals(params, source):
        tree = DraftTree(proposal.tokens, proposal.parents or list(range(-1, len(proposal.tokens) - 1)), proposal.q)
        chain = tree.main_chain()
        assert chain == list(range(len(chain)))  # the chain first, as the engine assumes
        for i, node in enumerate(chain):
            parent = node - 1
            siblings = [j for j in tree.children(parent) if j != node]
            expected = source.continuation(CONTEXT, [proposal.tokens[c] for c in chain[:i]], len(chain) - i)
            one_hot = [j for j in siblings if float(proposal.q[j].max()) == 1.0 and float(proposal.q[j].sum()) == 1.0]
            heads = [j for j in one_hot if expected and proposal.tokens[j] == expected[0]]
            sampled = [j for j in siblings if j not in heads]
            if heads:  # a copy here: it leaves the chain, and below its head runs the rest of the copy
                copies += 1
                assert len(heads) == 1 and expected[0] != proposal.tokens[node]
                walk, below = [proposal.tokens[heads[0]]], heads[0]
                while tree.children(below):
                    (below,) = tree.children(below)
                    walk.append(proposal.tokens[below])
                    assert float(proposal.q[below, proposal.tokens[below]]) == 1.0
                assert walk == expected[:len(walk)]
            for j in sampled:  # an alternative: never the chain's token nor the copy's head
                x = proposal.tokens[j]
                assert x != proposal.tokens[node] and not (heads and x == expected[0])
                if not params.greedy:  # its q is the pool it was drawn from
                    assert float(proposal.q[j, proposal.tokens[node]]) == 0.0
                    assert not heads or float(proposal.q[j, expected[0]]) == 0.0
                    assert abs(float(proposal.q[j].sum()) - 1.0) < 1e-9
        for m in range(len(proposal.gains or []) + 1):  # every subset the cost model may keep is a tree
            kept = proposal.keep_alternatives(m)
            if kept.parents is not None:
                DraftTree(kept.tokens, kept.parents, kept.q)
    assert copies >= 5  # copies were made often enough for the checks above to mean something


def test_no_source_no_copies():
    """Without a branch source the tree holds the chain and the draft's alternatives only (as before)."""
    for proposal, _ in proposals(SamplingParams(), None, seeds=10):
        if proposal.parents is None:
            continue
        chain = DraftTree(proposal.tokens, proposal.parents).main_chain()
        assert all(proposal.parents[j] < len(chain) - 1 for j in range(len(chain), len(proposal.tokens)))


def test_reset_and_fork_carry_the_source():
    _, draft = tiny_pair(vocab=V, seed=11)
    drafter = ModelDrafter(draft, tree=2, branches=LookupDrafter())
    drafter.propose(CONTEXT, 2, SamplingParams(), torch.Generator().manual_seed(0))
    assert drafter.branches.index.tokens == CONTEXT
    drafter.reset()
    assert drafter.branches.index.tokens == []
    fork = drafter.fork()
    assert isinstance(fork.branches, LookupDrafter) and fork.branches is not drafter.branches
