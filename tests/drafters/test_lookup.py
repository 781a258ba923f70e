"""Prompt-lookup drafter: table tests, limits, and the incremental index == the pure function."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdecode.core.probs import GREEDY
from specdecode.drafters.lookup import LookupConfig, LookupDrafter, NgramIndex, lookup
from specdecode.drafters.protocol import Situation

CFG = LookupConfig(min_n=2, max_n=3, max_proposal=5)


@pytest.mark.parametrize("context, k, expected", [
    ([1, 2, 3, 4, 5], 4, []),  # no match
    ([1, 2, 3, 4, 1, 2], 4, [3, 4, 1, 2]),  # match, proposal truncated at the context end
    ([1, 2, 3, 9, 9, 1, 2], 2, [3, 9]),  # k limits the proposal
    ([7, 1, 2, 5, 8, 1, 2, 6, 3, 1, 2], 3, [6, 3, 1]),  # most recent occurrence of the 2-gram
    ([4, 1, 2, 5, 9, 1, 2, 6, 4, 1, 2], 3, [5, 9, 1]),  # longest match (3-gram 4 1 2) wins over recency
    ([5, 5, 5, 5], 4, [5]),  # overlapping matches: 3-gram ending at index 2, one token follows
    ([1, 2], 4, []),  # the suffix itself is not a match
    ([3, 1, 2, 3, 1, 2, 3], 9, [1, 2, 3]),  # repetition; max_proposal 5 but context ends first
])
def test_table(context, k, expected):
    assert lookup(context, k, CFG) == expected


def test_never_beyond_max_proposal():
    context = list(range(20)) + list(range(3))
    assert lookup(context, 50, CFG) == [3, 4, 5, 6, 7]
    assert len(lookup(context, 50, LookupConfig(max_proposal=2))) == 2


def test_bad_config():
    with pytest.raises(ValueError, match="min_n"):
        LookupConfig(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="max_proposal"):
        LookupConfig(max_proposal=0)
    # types: each fails here, naming the field, not later inside the index (1.5 passed the range check)
    for field, bad in (("min_n", 1.5), ("max_n", float("inf")), ("max_proposal", None), ("long_match", "16"),
                       ("min_n", True)):
        with pytest.raises(ValueError, match=f"{field} must be an integer"):
            LookupConfig(**{field: bad})
    assert LookupConfig(min_n=np.int64(2), max_n=np.int64(3)).max_n == 3  # numpy integers are integers


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_incremental_index_equals_pure_function(tokens, steps):
    """Growing the index piece by piece proposes exactly what a fresh scan proposes."""
    index = NgramIndex(CFG)
    pos = 0
    for step in steps:
        index.extend(tokens[pos: pos + step])
        pos = min(len(tokens), pos + step)
        assert index.propose(4) == lookup(tokens[:pos], 4, CFG)


def test_brute_force_agrees():
    """`lookup` against a direct definition: longest n in [min_n, max_n], latest earlier end."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        ctx = torch.randint(0, 3, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        expected = []
        for n in range(CFG.max_n, CFG.min_n - 1, -1):
            if len(ctx) < n:
                continue
            ends = [e for e in range(n - 1, len(ctx) - 1) if ctx[e + 1 - n: e + 1] == ctx[len(ctx) - n:]]
            if ends:
                expected = ctx[ends[-1] + 1: ends[-1] + 1 + 4]
                break
        assert lookup(ctx, 4, CFG) == expected, ctx


def test_drafter_adapter_is_deterministic_and_resets():
    d = LookupDrafter(CFG)
    g = torch.Generator()
    p = d.propose([1, 2, 3, 1, 2], 3, GREEDY, g)
    assert p.tokens == [3, 1, 2] and p.q is None
    assert d.propose([1, 2, 3, 1, 2, 3], 3, GREEDY, g).tokens == [1, 2, 3]
    assert d.propose([9, 9], 3, GREEDY, g).tokens == []  # shorter context: a new request


def test_match_length_counts_back_past_max_n_and_classes_it():
    """The situation is the length of the history the current suffix shares with the occurrence
    lookup copies from (max_n = 4 finds it; the count goes back further), in bit-length classes."""
    drafter = LookupDrafter(LookupConfig(min_n=2, max_n=4, long_match=16))
    fresh = list(range(100, 120))
    assert drafter.situation(fresh) is None  # nothing repeats: no match, no class
    drafter.reset()
    assert drafter.situation([7, 8, 1, 2, 9, 1, 2]) == Situation(2, 0.50)  # a 2-token coincidence (1, 2)
    drafter.reset()
    copied = fresh[:10] + [0] + fresh[:6]  # the last 6 tokens repeat an earlier stretch
    assert drafter.index.match_length(16) == 0 and drafter.situation(copied) == Situation((6).bit_length(), 0.70)
    drafter.reset()
    long = fresh + [0] + fresh  # a 20-token copy: capped at 16, the top class
    assert drafter.situation(long) == Situation(5, 0.96) and drafter.index.match_length(16) == 16
    assert drafter.index.match_length(64) == 20
    # the class describes the match `propose` copies from: its continuation is what follows it
    assert drafter.continuation(long, (), 1) == [0]  # what followed fresh's first occurrence


def test_long_match_must_cover_max_n():
    with pytest.raises(ValueError, match="long_match"):
        LookupConfig(max_n=4, long_match=3)


def test_match_priors_are_checked_and_read_by_length():
    config = LookupConfig()
    assert [config.prior(m) for m in (1, 2, 3, 4, 7, 8, 15, 16, 40)] == [0.5, 0.5, 0.5, 0.7, 0.7, 0.85, 0.85, 0.96, 0.96]
    assert LookupConfig(match_priors=[[2, 0.5]]).match_priors == ((2, 0.5),)  # lists are pairs too, kept hashable
    for bad in ((), ((4, 0.7), (2, 0.5)), ((2, 1.0),), ((2, 0.5), (2, 0.6)), [(2, "x")], [(2.5, 0.5)], 5, ((2,),)):
        with pytest.raises(ValueError, match="match_priors"):
            LookupConfig(match_priors=bad)
