"""The embedded Qwen2.5-Coder pair, for real (slow: minutes on a 2-core CPU).

Token identity is claimed in float32: in bf16 a K-token verification pass and K
one-token steps round differently, so greedy outputs may legitimately diverge.
"""

import pytest

from specdecode.backends.weights import DRAFT, TARGET, part_paths
from specdecode.core.probs import GREEDY
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
    return SpeculativeDecoder.load(dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_fp32_identical_to_plain(decoder, prompt):
    config = GenerationConfig(max_new_tokens=64, sampling=GREEDY, k=4)
    spec = decoder.generate(prompt, config, chat=True)
    plain = decoder.generate(prompt, config, chat=True, speculative=False)
    assert spec.tokens == plain.tokens
    assert len(spec.tokens) == 64 or spec.finish_reason == "stop"
    assert spec.stats.accepted > 0 and spec.stats.alpha > 0.5  # the pair agrees: speculation is exercised
    assert spec.stats.num_rounds < plain.stats.num_rounds
