"""The embedded Qwen2.5-Coder pair, for real (slow: minutes on a 2-core CPU).

Token identity is claimed in float32: in bf16 a K-token verification pass and K
one-token steps round differently, so greedy outputs may legitimately diverge.
"""

import pytest

from specdecode.backends.weights import DRAFT, TARGET, part_paths
from specdecode.core.probs import GREEDY
from specdecode.drafters.lookup import LookupDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Implement binary search over a sorted list in Python, with a docstring.",
    "Write a JavaScript function that debounces another function.",
]


def test_parts_are_installed_and_sized():
    for spec in (TARGET, DRAFT):
        paths = part_paths(spec)
        assert len(paths) == spec.parts
        assert sum(p.stat().st_size for p in paths) == spec.size


@pytest.fixture(scope="module")
def decoder():
    """transformers in fp32, with the CPU-default cheap draft (int8 weights, 32k-token head) and lookup."""
    return SpeculativeDecoder.load(backend="transformers", dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def plain(decoder):
    config = GenerationConfig(max_new_tokens=64, sampling=GREEDY, k=1)
    return {p: decoder.generate(p, config, chat=True, speculative=False) for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_fp32_identical_to_plain_model_drafter(decoder, plain, prompt):
    model_only = SpeculativeDecoder(decoder.target, decoder.tokenizer, decoder.drafters[-1:])
    spec = model_only.generate(prompt, GenerationConfig(max_new_tokens=64, sampling=GREEDY, k=4), chat=True)
    assert spec.tokens == plain[prompt].tokens
    assert len(spec.tokens) == 64 or spec.finish_reason == "stop"
    assert spec.stats.accepted > 0 and spec.stats.alpha > 0.5  # the pair agrees: speculation is exercised
    assert spec.stats.num_rounds < plain[prompt].stats.num_rounds


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_fp32_identical_auto_adaptive(decoder, plain, prompt):
    spec = decoder.generate(prompt, GenerationConfig(max_new_tokens=64, sampling=GREEDY, k=None), chat=True)
    assert spec.tokens == plain[prompt].tokens
    assert spec.stats.drafted > 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_fp32_identical_lookup(decoder, plain, prompt):
    lookup = SpeculativeDecoder(decoder.target, decoder.tokenizer, [LookupDrafter()])
    spec = lookup.generate(prompt, GenerationConfig(max_new_tokens=64, sampling=GREEDY, k=6), chat=True)
    assert spec.tokens == plain[prompt].tokens
