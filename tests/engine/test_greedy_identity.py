"""Greedy speculative output is token-identical to plain greedy decoding (float64 tiny models)."""

import pytest
import torch

from specdecode.core.probs import GREEDY
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.engine import generate_tokens
from specdecode.engine.policy import AdaptiveK
from specdecode.engine.stats import GenerationStats
from tests.tiny import tiny_pair

NO_EOS = frozenset()


def run(target, drafter, prompt, k, max_new=40, eos=NO_EOS, stats=None, policy=None):
    config = GenerationConfig(max_new_tokens=max_new, sampling=GREEDY, k=k)
    drafters = [] if drafter is None else drafter if isinstance(drafter, list) else [drafter]
    return [t for r in generate_tokens(target, drafters, prompt, config, eos, stats, policy) for t in r.tokens]


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(vocab=64, seed=1, noise=0.1)


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_identical_to_baseline(pair, k):
    target, draft = pair
    drafter = ModelDrafter(draft)
    g = torch.Generator().manual_seed(k)
    accepted = 0
    for _ in range(6):
        prompt = torch.randint(1, 64, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        baseline = run(target, None, prompt, k)
        stats = GenerationStats()
        assert run(target, drafter, prompt, k, stats=stats) == baseline
        accepted += stats.accepted
    assert accepted > 0  # the draft agrees sometimes: multi-token rounds were exercised


def test_max_new_tokens_exact_even_inside_a_round(pair):
    target, draft = pair
    for max_new in [1, 2, 3, 5, 13]:
        out = run(target, ModelDrafter(draft), [5, 6, 7], k=8, max_new=max_new)
        assert len(out) == max_new
        assert out == run(target, None, [5, 6, 7], k=8, max_new=max_new)


def test_eos_inside_an_accepted_run_stops_there(pair):
    target, draft = pair
    prompt = [3, 9, 27]
    baseline = run(target, None, prompt, k=4, max_new=30)
    eos_tok = baseline[6]
    first = baseline.index(eos_tok)
    stats = GenerationStats()
    out = run(target, ModelDrafter(draft), prompt, k=4, max_new=30, eos=frozenset([eos_tok]), stats=stats)
    assert out == baseline[: first + 1]
    assert stats.finish_reason == "stop"


def test_eos_inside_an_accepted_run_counts_only_drafts_up_to_it(pair):
    """q == p accepts all K drafts; with EOS as the 2nd draft, the output stops there and the
    statistics count 2 accepted (and 2 tested) drafts, not the 4 the verification accepted."""
    target, _ = pair
    from specdecode.backends.hf import HFModel
    clone = HFModel(target.model, "same-weights")
    prompt = [1, 2]
    baseline = run(target, None, prompt, k=4, max_new=25)
    assert baseline[1] != baseline[0]  # so the EOS first appears as the 2nd token
    stats = GenerationStats()
    out = run(target, ModelDrafter(clone), prompt, k=4, max_new=25, eos=frozenset([baseline[1]]), stats=stats)
    assert out == baseline[:2]
    assert [(r.drafted, r.accepted, r.emitted) for r in stats.rounds] == [(4, 2, 2)]
    assert stats.accepted == 2 and stats.reached_per_position == [1, 1] and stats.alpha == 1.0


def test_draft_equal_to_target_accepts_everything(pair):
    """With q == p every draft is accepted and every round emits K + 1 tokens (the bonus)."""
    target, _ = pair
    from specdecode.backends.hf import HFModel
    clone = HFModel(target.model, "same-weights")
    stats = GenerationStats()
    out = run(target, ModelDrafter(clone), [1, 2], k=4, max_new=25, stats=stats)
    assert out == run(target, None, [1, 2], k=4, max_new=25)
    assert stats.alpha == 1.0
    assert [r.emitted for r in stats.rounds] == [5] * 5


@pytest.mark.parametrize("kind", ["lookup", "auto", "auto-adaptive", "model-adaptive", "model-confident"])
def test_every_drafter_and_policy_is_greedy_identical(pair, kind):
    target, draft = pair
    drafters = {"lookup": [LookupDrafter()], "auto": [LookupDrafter(), ModelDrafter(draft)],
                "auto-adaptive": [LookupDrafter(), ModelDrafter(draft)], "model-adaptive": [ModelDrafter(draft)],
                "model-confident": [ModelDrafter(draft, min_confidence=0.5)]}[kind]
    policy = AdaptiveK(k_max=6) if kind.endswith("adaptive") else None
    if policy:  # costs under which drafting pays (tiny target and draft cost alike when timed)
        policy.load_costs({"t_verify": {str(n): 0.01 for n in range(1, 8)},
                           "t_step": {"lookup": 1e-5, "model": 1e-3}})
    g = torch.Generator().manual_seed(99)
    proposed = 0
    for _ in range(5):
        # repetitive prompts give the lookup drafter something to find
        motif = torch.randint(1, 64, (4,), generator=g).tolist()
        prompt = motif * 3 + torch.randint(1, 64, (3,), generator=g).tolist()
        stats = GenerationStats()
        out = run(target, drafters, prompt, k=None if policy else 4, stats=stats, policy=policy, max_new=30)
        assert out == run(target, None, prompt, k=4, max_new=30)
        proposed += stats.drafted
    assert proposed > 0
