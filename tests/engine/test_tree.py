"""Draft trees through the engine (transformers backend, tiny models built in-process).

- Greedy: with a tree drafter (the draft model's, with and without prompt lookup's copies; the
  suffix drafter's) the output is token for token the plain output (float64), and alternatives
  (copies) won rounds (so the tree path, accept_path included, was exercised).
- Sampled: the engine chi-square of the first two tokens (false-failure probability 1e-3 per
  test at fixed seeds) with each tree drafter (sampled candidates; deterministic ones); its
  negative control verifies the tree with a residual that keeps rejected candidates, and must fail.
- Reproducible: a tree changes nothing in the sample of a seed.
- Batches: a tree row beside chain and plain rows gives its solo tokens.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specdecode.core import tree as tree_rule
from specdecode.core.probs import SamplingParams
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.engine import Engine
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.engine.slot import Slot
from specdecode.engine.stats import GenerationStats
from tests.engine.test_sampling_exact import PROMPT, V, joint_p_value, pair  # noqa: F401 (a fixture)
from tests.tiny import char_tokenizer, tiny_pair


def run(target, drafters, prompt, config):
    """Generate with the prompt's K/V already in the cache (as a prefix cache leaves it: a request on the
    same prompt ran in the slot before), so the first round drafts a tree too: a round that feeds the
    prompt's rest is a chain (engine/round.py)."""
    engine = Engine([Slot(target, tuple(drafters))], frozenset(), scheduling=SchedulerConfig(persistent=True))
    engine.generate_ids(prompt, GenerationConfig(max_new_tokens=1), speculative=False)
    stats = GenerationStats()
    request = engine.add_request(prompt, config, stats=stats)
    assert not request.unfed
    return [t for chunk in engine.follow(request) for t in chunk.tokens], stats


def test_hf_tree_pass_equals_chains_and_keeps_the_path():
    target, _ = tiny_pair(seed=3, dtype=torch.float64)
    prefix, tokens, parents = [5, 6, 7, 8], [9, 10, 11, 12, 13], [-1, 0, 0, 1, 1]
    target.truncate(0)
    target.forward(prefix, 1)
    tree_logits = target.forward_tree(tokens, parents)
    for j, path in enumerate([[9], [9, 10], [9, 11], [9, 10, 12], [9, 10, 13]]):
        target.truncate(0)
        chain = target.forward(prefix + path, 1)[0]
        assert torch.allclose(tree_logits[j], chain, atol=1e-10), j
    target.truncate(0)
    target.forward(prefix, 1)
    target.forward_tree(tokens, parents)
    target.accept_path([0, 1, 4])  # root 9, then 10, then 13
    assert target.length == len(prefix) + 3
    after = target.forward([14], 1)[0]
    target.truncate(0)
    assert torch.allclose(after, target.forward(prefix + [9, 10, 13, 14], 1)[0], atol=1e-10)


@pytest.mark.parametrize("copies", [False, True], ids=["alternatives", "with-lookup-copies"])
def test_greedy_tree_output_is_the_plain_output(copies):
    target, draft = tiny_pair(seed=1, noise=0.3, dtype=torch.float64)
    greedy = SamplingParams(temperature=0.0)
    won, nodes = 0, 0
    for prompt in ([3, 4, 5, 3, 4], [10, 11, 12, 13], [7, 7, 8, 9, 7, 7]):
        plain, _ = run(target, [], prompt, GenerationConfig(max_new_tokens=40, sampling=greedy))
        for k in (2, 4):
            drafter = ModelDrafter(draft, tree=4, branches=LookupDrafter() if copies else None)
            spec, stats = run(target, [drafter], prompt, GenerationConfig(max_new_tokens=40, sampling=greedy, k=k))
            assert spec == plain, (prompt, k)
            won += stats.off_chain_rounds
            nodes += sum(r.tree_nodes for r in stats.rounds)
    assert nodes > 0 and won > 0  # trees were verified, and alternatives (copies) won rounds


# in this earlier request (4, 1, 2) continued 0, 5, 4 and 3, once each: longer than any match in
# PROMPT (which ends 4 1 2), so after PROMPT the suffix drafter's chain starts with 3, the latest,
# and its branches 0, 5 and 4 sit beside it
HISTORY = [4, 1, 2, 0, 4, 1, 2, 5, 4, 1, 2, 4, 4, 1, 2, 3]


def suffix_tree(draft=None) -> SuffixDrafter:
    drafter = SuffixDrafter(SuffixConfig(min_n=1, max_n=3, min_score=0.1), tree=3)
    drafter.propose(HISTORY, 1, SamplingParams(), torch.Generator())
    drafter.reset()  # HISTORY is an earlier request's text
    return drafter


def model_tree(draft) -> ModelDrafter:
    return ModelDrafter(draft, tree=3, min_gain=0.0)


def model_tree_with_copies(draft) -> ModelDrafter:
    """The draft model's tree with prompt lookup's continuations as copies (after PROMPT lookup
    continues 3, 4, ...: a deterministic sibling of the draft's sampled token where it is not 3,
    and a chain below it). 12 extra nodes hold every alternative of V = 6 at K = 2 and the copies."""
    return ModelDrafter(draft, tree=12, min_gain=0.0, branches=LookupDrafter())


def test_copies_are_in_the_trees_the_exactness_test_verifies(pair):
    _, draft = pair
    drafter = model_tree_with_copies(draft)
    with_copy = 0
    for seed in range(50):
        drafter.reset()
        proposal = drafter.propose(PROMPT, 2, SamplingParams(), torch.Generator().manual_seed(seed))
        root_children = [j for j, parent in enumerate(proposal.parents or []) if parent == -1]
        with_copy += any(proposal.tokens[j] == 3 and float(proposal.q[j, 3]) == 1.0 for j in root_children[1:])
    assert with_copy >= 10, with_copy


def tree_p_value(target, draft, params, make_drafter=model_tree, n=1500, k=2):
    counts = {key: 0 for key in itertools.product(range(V), repeat=2)}
    off_chain = 0
    for seed in range(n):
        config = GenerationConfig(max_new_tokens=k + 1, sampling=params, k=k, seed=seed)
        tokens, stats = run(target, [make_drafter(draft)], PROMPT, config)
        counts[tuple(tokens[:2])] += 1
        off_chain += stats.off_chain_rounds
    assert off_chain >= 0.05 * n, off_chain  # alternatives won often enough for the test to see them
    return joint_p_value(target, params, counts)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=3)], ids=["t1", "t0.7-topk3"])
def test_sampled_tree_is_exact(pair, params):
    target, draft = pair
    assert tree_p_value(target, draft, params) > 1e-3


def test_suffix_tree_is_exact(pair):
    target, draft = pair
    assert tree_p_value(target, draft, SamplingParams(), suffix_tree) > 1e-3


def test_model_tree_with_copies_is_exact(pair):
    target, draft = pair
    assert tree_p_value(target, draft, SamplingParams(), model_tree_with_copies) > 1e-3


@pytest.mark.parametrize("make_drafter", [model_tree, suffix_tree, model_tree_with_copies],
                         ids=["model", "suffix", "model-with-copies"])
def test_tree_negative_control_fails(pair, monkeypatch, make_drafter):
    """The same test with a residual that keeps rejected candidates' mass must fail."""
    monkeypatch.setattr(tree_rule, "residual", lambda r, q_c, x: r)
    target, draft = pair
    assert tree_p_value(target, draft, SamplingParams(), make_drafter) < 1e-3


def test_greedy_suffix_tree_output_is_the_plain_output():
    target, _ = tiny_pair(seed=1, noise=0.3, dtype=torch.float64)
    greedy = SamplingParams(temperature=0.0)
    won = 0
    # one-token contexts: their continuations branch often, so some branches win
    drafter = SuffixDrafter(SuffixConfig(min_n=1, max_n=1, min_score=0.05), tree=4)
    for prompt in ([3, 4, 5, 3, 4, 6, 3, 4], [10, 11, 12, 13, 10, 11, 9], [7, 7, 8, 9, 7, 7, 5, 7]):
        plain, _ = run(target, [], prompt, GenerationConfig(max_new_tokens=40, sampling=greedy))
        for k in (2, 4):
            spec, stats = run(target, [drafter], prompt, GenerationConfig(max_new_tokens=40, sampling=greedy, k=k))
            assert spec == plain, (prompt, k)
            won += stats.off_chain_rounds
    assert won > 0  # a branch, not the chain, was accepted in some rounds


@pytest.fixture(scope="module")
def decoder():
    target, draft = tiny_pair(seed=5, noise=0.2, dtype=torch.float32, scale=0.3)
    return SpeculativeDecoder(target, char_tokenizer(), [ModelDrafter(draft, tree=4)], eos_ids=[0], max_batch=3)


def test_reproducible_sample_is_unchanged_by_a_tree(decoder):
    sampled = SamplingParams(temperature=0.9, top_p=0.95)
    won = 0
    for seed in range(4):
        config = GenerationConfig(max_new_tokens=40, sampling=sampled, k=3, seed=seed, reproducible=True)
        plain = decoder.generate("abcab", config, speculative=False)
        spec = decoder.generate("abcab", config)
        assert spec.tokens == plain.tokens
        won += spec.stats.off_chain_rounds
    assert won > 0


def test_tree_rows_in_a_batch_give_their_solo_tokens(decoder):
    greedy = SamplingParams(temperature=0.0)
    prompts = ["hello wor", "abcabcab", "x = 1\ny = "]
    configs = [GenerationConfig(max_new_tokens=30, sampling=greedy, k=3),
               GenerationConfig(max_new_tokens=20, sampling=greedy, k=1),
               GenerationConfig(max_new_tokens=25, sampling=SamplingParams(temperature=0.8), k=2, seed=4)]
    solo = [decoder.generate(p, c).tokens for p, c in zip(prompts, configs)]
    batched = decoder.generate_many(prompts, configs)
    assert [r.tokens for r in batched] == solo
    assert sum(r.stats.mean_tree_nodes > 0 for r in batched) == 3
