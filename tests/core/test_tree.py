"""Draft trees: the multi-candidate rule's law by enumeration, the implementation against its
dense reference bit for bit, and the implementation's samples against the target (chi-square).

Enumeration: `tree_round_law` sums over every way the tree's candidates can be drawn (sampled
without replacement from q, deterministic top-m of q, or a deterministic "lookup" guess followed
by sampled candidates) and every accept/reject outcome of the walk, exactly, in float64; rounds
are repeated until depth + 1 tokens exist and that law must equal the target's joint to 1e-12.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch

from specdecode.core import tree as tree_rule
from specdecode.core.probs import SamplingParams, logits_to_probs, sample
from specdecode.core.tree import DraftTree, remove, residual, verify_tree, verify_tree_reference
from specdecode.stats import chi_square
from tests.core.test_enumeration import speculative_joint
from tests.toy import ToyModel

KINDS = ("sampled", "top", "lookup+sampled")


def guess(ctx: tuple[int, ...], vocab: int) -> int:
    """A deterministic drafter's token (stands in for prompt lookup): a function of the context only."""
    return (len(ctx) + 3 * sum(ctx)) % vocab


def candidate_laws(kind: str, ctx: tuple[int, ...], q: torch.Tensor, index: int, drawn_q: torch.Tensor):
    """The law of a node's candidate number `index` given the earlier ones: [(x, P(x), q_c)],
    q_c None for a deterministic candidate. drawn_q: q without the earlier sampled siblings."""
    if kind == "top" or (kind == "lookup+sampled" and index == 0):
        x = guess(ctx, len(q)) if kind != "top" else int(drawn_q.argmax())
        return [(x, 1.0, None)] if kind != "top" or drawn_q.sum() > 0 else []
    return [(x, float(drawn_q[x]), drawn_q) for x in range(len(q)) if drawn_q[x] > 0]


def tree_round_law(target: ToyModel, draft: ToyModel, ctx: tuple[int, ...], shape: tuple[int, ...], kind: str,
                   keep_rejected: bool = False) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one tree round emits from `ctx`; shape[d] candidates below every
    node at depth d. keep_rejected: the broken rule that leaves a rejected candidate's mass in r."""
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def node(prefix: tuple[int, ...], prob: float) -> None:
        m = shape[len(prefix)] if len(prefix) < len(shape) else 0
        siblings(prefix, target.probs(ctx + prefix), draft.probs(ctx + prefix), m, 0, prob)

    def siblings(prefix, r, drawn_q, left, index, prob) -> None:
        laws = candidate_laws(kind, ctx + prefix, draft.probs(ctx + prefix), index, drawn_q) if left else []
        if not laws:  # no candidate left: the residual (or p itself: the bonus)
            for y in range(len(r)):
                if r[y] > 0:
                    out[prefix + (y,)] += prob * float(r[y])
            return
        for x, px, q_c in laws:
            q_x = 1.0 if q_c is None else float(q_c[x])
            accept = min(1.0, float(r[x]) / q_x)
            if accept > 0:
                node(prefix + (x,), prob * px * accept)
            if accept < 1:
                nxt = r if keep_rejected else residual(r, q_c, x)
                # the next draw excludes x, except after the lookup guess (sampled ones come from q)
                sampled_next = drawn_q if q_c is None and kind != "top" else remove(drawn_q, x)
                siblings(prefix, nxt, sampled_next, left - 1, index + 1, prob * px * (1 - accept))

    node((), 1.0)
    return out


def tree_joint(target, draft, shape, kind, keep_rejected=False):
    length = len(shape) + 1
    law = lambda t, d, ctx, k: tree_round_law(t, d, ctx, shape, kind, keep_rejected)  # noqa: E731
    return speculative_joint(target, draft, len(shape), length, round_law=law), target.joint(length)


CASES = [  # (vocab, shape): depth <= 3, branching <= 3
    (3, (3,)), (4, (2, 2)), (5, (3, 1)), (3, (1, 3)), (4, (1, 1, 1)), (3, (2, 2, 2)), (5, (2, 1, 1)),
]
PARAMS = {"t1": SamplingParams(), "t0.8-topk3": SamplingParams(temperature=0.8, top_k=3),
          "topp0.7": SamplingParams(top_p=0.7), "greedy": SamplingParams(temperature=0.0)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("zeros", [False, True], ids=["dense", "zeros"])
@pytest.mark.parametrize("vocab, shape", CASES, ids=[f"V{v}-{'x'.join(map(str, s))}" for v, s in CASES])
def test_tree_law_is_the_target_joint(vocab, shape, zeros, params, kind):
    target = ToyModel(vocab, seed=30 + vocab, params=PARAMS[params], zeros=zeros)
    draft = ToyModel(vocab, seed=40 + len(shape), sharpness=1.0, params=PARAMS[params], zeros=zeros)
    spec, exact = tree_joint(target, draft, shape, kind)
    for seq in itertools.product(range(vocab), repeat=len(shape) + 1):
        assert spec.get(seq, 0.0) == pytest.approx(exact[seq], abs=1e-12), seq


def test_deep_deterministic_tree_is_exact():
    """Depth 3, three deterministic candidates per node (39 nodes), V = 5."""
    target, draft = ToyModel(5, seed=3), ToyModel(5, seed=4, sharpness=1.0)
    spec, exact = tree_joint(target, draft, (3, 3, 3), "top")
    assert max(abs(spec.get(s, 0.0) - exact[s]) for s in exact) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_enumeration_catches_a_sibling_accepted_without_removing_the_rejected(kind):
    """Negative control: leave a rejected candidate's mass in the residual; the law moves."""
    target, draft = ToyModel(4, seed=5), ToyModel(4, seed=6, sharpness=1.0)
    spec, exact = tree_joint(target, draft, (3, 1), kind, keep_rejected=True)
    assert max(abs(spec.get(s, 0.0) - exact[s]) for s in exact) > 1e-3


def test_one_candidate_per_node_is_the_chain_rule():
    """A chain is a tree: the law of the chain's enumeration (test_enumeration) is reproduced."""
    from tests.core.test_enumeration import round_law
    target, draft = ToyModel(4, seed=8), ToyModel(4, seed=9, sharpness=1.0)
    chain = round_law(target, draft, (), 2)
    tree = tree_round_law(target, draft, (), (1, 1), "sampled")
    assert set(chain) == set(tree) and all(abs(chain[s] - tree[s]) < 1e-12 for s in chain)


# --- the implementation -------------------------------------------------------------------------

def random_tree(g: torch.Generator, vocab: int, shape: tuple[int, ...], kind: str, params: SamplingParams,
                zeros: bool) -> tuple[DraftTree, torch.Tensor]:
    """A tree drawn as a drafter would (breadth first), with random q and p rows; returns (tree, p)."""
    def dist() -> torch.Tensor:
        logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 2
        if zeros:
            logits[torch.rand(vocab, generator=g) < 0.3] = float("-inf")
            logits[int(torch.randint(vocab, (1,), generator=g))] = 0.0
        return logits_to_probs(logits, params)

    tokens, parents, q_rows = [], [], []
    level = [-1]
    for m in shape:
        nxt = []
        for parent in level:
            q, drawn = dist(), None
            drawn = q
            for i in range(m):
                if kind == "top" or (kind == "lookup+sampled" and i == 0):
                    x = int(drawn.argmax()) if kind == "top" else int(torch.randint(vocab, (1,), generator=g))
                    row = torch.zeros(vocab, dtype=torch.float64).index_fill_(0, torch.tensor([x]), 1.0)
                    if kind == "top":
                        drawn = remove(drawn, x)
                else:
                    if drawn.sum() <= 0:
                        break
                    x, row = int(torch.multinomial(drawn, 1, generator=g)), drawn
                    drawn = remove(drawn, x)
                tokens.append(x)
                parents.append(parent)
                q_rows.append(row)
                nxt.append(len(tokens) - 1)
        level = nxt
    p = torch.stack([dist() for _ in range(len(tokens) + 1)])
    return DraftTree(tokens, parents, torch.stack(q_rows)), p


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("params", list(PARAMS))
def test_implementation_equals_reference_bit_for_bit(kind, params):
    g = torch.Generator().manual_seed(11)
    for case in range(40):
        shape = [(3,), (2, 2), (1, 3), (3, 2, 1), (2, 2, 2)][case % 5]
        tree, p = random_tree(g, 6, shape, kind, PARAMS[params], zeros=case % 2 == 1)
        u = torch.rand(len(tree), generator=g, dtype=torch.float64)
        v = torch.rand((), generator=g, dtype=torch.float64)
        expected = verify_tree_reference(tree, p, u, v)
        assert verify_tree(tree, p, u, v).tokens == expected
        if kind == "top":  # all deterministic: the same walk without V-sized q rows
            light = DraftTree(tree.tokens, tree.parents, None)
            assert verify_tree(light, p, u, v).tokens == expected


def test_result_path_matches_tokens_and_depths():
    tree = DraftTree([1, 2, 3, 0], [-1, -1, 0, 2])
    assert tree.children(-1) == [0, 1] and tree.depths() == [1, 1, 2, 3] and tree.path_to(3) == [0, 2, 3]
    p = torch.zeros(5, 4, dtype=torch.float64)
    p[:, 3] = 1.0
    p[0] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # the target wants 1 at the root, then 3, then 0
    p[1] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    p[3] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    result = verify_tree(tree, p, torch.zeros(4, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64))
    assert result.path == [0, 2, 3] and result.tokens == [1, 3, 0, 3]


@pytest.mark.parametrize("bad, message", [
    (lambda: DraftTree([1, 2], [-1]), "one parent per token"),
    (lambda: DraftTree([1, 2], [1, -1]), "earlier node"),
    (lambda: verify_tree(DraftTree([1], [-1]), torch.ones(1, 3) / 3, torch.zeros(1), torch.tensor(0.5)), "N\\+1"),
    (lambda: verify_tree(DraftTree([7], [-1]), torch.ones(2, 3) / 3, torch.zeros(1), torch.tensor(0.5)), "token ids"),
    (lambda: verify_tree(DraftTree([1], [-1]), torch.ones(2, 3) / 3, torch.zeros(1), torch.ones(3)), "scalar v"),
])
def test_bad_trees_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def _sample_first_two(kind: str, n: int, seed: int):
    """n rounds of one fixed tree scenario through `verify_tree`; the first two tokens of each
    (a round that emitted one token is completed by a sample from the target after it)."""
    vocab, params = 4, SamplingParams(temperature=0.9)
    target, draft = ToyModel(vocab, seed=21, params=params), ToyModel(vocab, seed=22, sharpness=1.0, params=params)
    g = torch.Generator().manual_seed(seed)
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for _ in range(n):
        tokens, parents, q_rows, contexts = [], [], [], {-1: ()}
        for parent, m in [(-1, 3)]:  # three candidates at the root, each with one child
            drawn = draft.probs(())
            for i in range(m):
                if kind == "top":
                    x = int(drawn.argmax())
                    row = torch.zeros(vocab, dtype=torch.float64).index_fill_(0, torch.tensor([x]), 1.0)
                else:
                    x, row = int(torch.multinomial(drawn, 1, generator=g)), drawn
                drawn = remove(drawn, x)
                tokens.append(x), parents.append(parent), q_rows.append(row)
                contexts[len(tokens) - 1] = (x,)
        for j in range(3):
            q = draft.probs(contexts[j])
            x = int(q.argmax()) if kind == "top" else int(torch.multinomial(q, 1, generator=g))
            row = torch.zeros(vocab, dtype=torch.float64).index_fill_(0, torch.tensor([x]), 1.0) \
                if kind == "top" else q
            tokens.append(x), parents.append(j), q_rows.append(row)
            contexts[len(tokens) - 1] = contexts[j] + (x,)
        tree = DraftTree(tokens, parents, torch.stack(q_rows))
        p = torch.stack([target.probs(())] + [target.probs(contexts[j]) for j in range(len(tokens))])
        out = verify_tree(tree, p, torch.rand(len(tree), generator=g, dtype=torch.float64),
                          torch.rand((), generator=g, dtype=torch.float64)).tokens
        if len(out) == 1:
            out.append(int(sample(target.probs(tuple(out)), g)))
        counts[(out[0], out[1])] += 1
    joint = target.joint(2)
    keys = sorted(joint)
    return chi_square([counts[k] for k in keys], [joint[k] for k in keys]).p_value


@pytest.mark.parametrize("kind", ["sampled", "top"])
def test_verify_tree_samples_match_the_target(kind):
    """Chi-square over 6000 rounds of a 6-node tree; false-failure probability 1e-3 (fixed seed)."""
    assert _sample_first_two(kind, 6000, seed=1) > 1e-3


def test_chi_square_catches_a_residual_that_keeps_the_rejected(monkeypatch):
    """Negative control through the implementation itself: `residual` returns r unchanged."""
    monkeypatch.setattr(tree_rule, "residual", lambda r, q_c, x: r)
    assert _sample_first_two("sampled", 6000, seed=1) < 1e-3
