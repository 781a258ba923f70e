"""The prompt cache in host memory: what it keeps, finds and forgets (engine/prompt_cache.py).
The scheduler's use of it (restore, then decode as alone) is tested in tests/engine/test_batch.py."""

import pytest

from specdecode.backends.protocol import Snapshot
from specdecode.engine.prompt_cache import PromptCache


def snap(ids, nbytes=10):
    return Snapshot(len(ids), object(), nbytes)


def test_the_longest_shared_start_wins():
    cache = PromptCache(1000)
    cache.put([1, 2, 3], snap([1, 2, 3]))
    cache.put([1, 5, 6, 7], snap([1, 5, 6, 7]))
    assert cache.best([1, 5, 6, 9])[0] == 3 and cache.best([1, 5, 6, 9])[1].ids == (1, 5, 6, 7)
    assert cache.best([1, 2, 3, 4])[1].ids == (1, 2, 3)
    assert cache.best([9, 1, 2]) == (0, None)  # a shared middle is no prefix


def test_a_longer_context_replaces_the_one_it_extends_and_a_covered_one_adds_nothing():
    cache = PromptCache(1000)
    cache.put([1, 2], snap([1, 2]))
    cache.put([1, 2, 3, 4], snap([1, 2, 3, 4]))
    assert len(cache) == 1 and cache.bytes == 10
    cache.put([1, 2, 3], snap([1, 2, 3]))  # the kept entry serves it
    assert len(cache) == 1 and cache.best([1, 2, 3, 4, 5])[0] == 4


def test_memory_is_bounded_least_recently_used_first():
    cache = PromptCache(25)
    cache.put([1], snap([1]))
    cache.put([2], snap([2]))
    cache.best([1, 0])  # [1] is used: [2] is now the oldest
    cache.put([3], snap([3]))
    assert cache.bytes == 20 and cache.best([2])[1] is None and cache.best([1])[0] == 1
    cache.put([4], snap([4], nbytes=26))  # larger than the whole bound: not kept, nothing evicted for it
    assert cache.best([4])[1] is None and len(cache) == 2


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=">= 0 bytes"):
        PromptCache(-1)
    with pytest.raises(ValueError, match="cannot hold"):
        PromptCache(100).put([1, 2], snap([1]))
