"""Suffix drafter: the latest continuation with its share of the counts as the score, which shortens
uncertain drafts; the current request before the history; cross-request history with its bound; and
the incremental index equal to one built from scratch."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdecode.core.probs import GREEDY
from specdecode.drafters.suffix import ContinuationCounts, SuffixConfig, SuffixDrafter

BIGRAMS = SuffixConfig(min_n=2, max_n=2, min_score=0.25, history_tokens=1000)


def propose(drafter: SuffixDrafter, context: list[int], k: int = 4) -> list[int]:
    return drafter.propose(context, k, GREEDY, torch.Generator()).tokens


def test_the_latest_continuation_is_drafted_unless_too_unlikely_then_the_most_frequent():
    # (1, 2) was followed by 7 twice and by 9 once (most recently): the draft is 9, as lookup's, with
    # a score of 1/3; under a min_score of 0.5 that is too unlikely and 7 (2/3) is drafted; under 0.7 nothing
    context = [1, 2, 7, 1, 2, 7, 1, 2, 9, 1, 2]
    assert propose(SuffixDrafter(BIGRAMS), context, k=1) == [9]
    assert propose(SuffixDrafter(SuffixConfig(min_n=2, max_n=2, min_score=0.5)), context, k=1) == [7]
    assert propose(SuffixDrafter(SuffixConfig(min_n=2, max_n=2, min_score=0.7)), context, k=1) == []


def test_ties_go_to_the_most_recent():
    assert propose(SuffixDrafter(BIGRAMS), [1, 2, 5, 1, 2, 6, 1, 2], k=1) == [6]


def test_the_draft_stops_where_the_text_branched_too_often():
    # (1, 2) -> 3: certain; (2, 3) -> 4, 5, 6, 8 or 0, one each: 1/5 < 0.3, so the draft ends after 3
    context = [2, 3, 4, 2, 3, 5, 2, 3, 6, 2, 3, 8, 1, 2, 3, 0, 1, 2]
    assert propose(SuffixDrafter(SuffixConfig(min_n=2, max_n=2, min_score=0.3)), context) == [3]
    assert len(propose(SuffixDrafter(SuffixConfig(min_n=2, max_n=2, min_score=0.2)), context)) > 1


def test_a_copied_span_is_drafted_in_full():
    context = [10, 11, 12, 13, 14, 15, 16, 99, 10, 11, 12]
    assert propose(SuffixDrafter(SuffixConfig()), context, k=4) == [13, 14, 15, 16]


def test_the_situation_is_the_match_length_class_and_whether_the_counts_agree():
    """Adaptive K learns acceptance per (length class, agreement): offline the first draft was accepted
    31-54% of the time after a 2-token match, 76-95% after 8, and 10-31% where the counts split."""
    def situation(context: list[int]):
        return SuffixDrafter(SuffixConfig()).situation(context)  # a fresh drafter: no history

    assert situation([1, 2, 3, 4, 5]) is None  # nothing repeats
    assert situation([7, 1, 2, 9, 8, 1, 2]) == (2, True)  # (1, 2) -> 9 once: 2 tokens, agreed
    assert situation([7, 1, 2, 9, 8, 1, 2, 6, 5, 1, 2]) == (2, False)  # (1, 2) -> 9 or 6: split
    copied = [10, 11, 12, 13, 14, 15, 16, 17, 18, 99, 10, 11, 12, 13, 14, 15, 16, 17]
    assert situation(copied) == ((8).bit_length(), True)  # the longest tail counted: max_n = 8
    assert situation(copied[:-3]) == ((5).bit_length(), True)  # a 5-token match: class 4-7
    assert situation(copied[:-4]) == ((4).bit_length(), True) != situation(copied[:-6])  # 4 and 2 tokens
    # the same drafter follows the request: the history's match counts where it is the longer
    drafter = SuffixDrafter(SuffixConfig())
    drafter.situation([6, 8, 1, 2, 3])  # request 1
    assert drafter.situation([7, 1, 2, 9, 6, 8, 1, 2]) == ((4).bit_length(), True)  # 6 8 1 2 -> 3 earlier


def test_the_current_request_goes_before_the_history_unless_the_history_matches_longer():
    drafter = SuffixDrafter(BIGRAMS)
    propose(drafter, [1, 2, 3, 1, 2, 3])  # request 1: (1, 2) -> 3 twice
    drafter.reset()
    assert propose(drafter, [1, 2, 9, 1, 2], k=1) == [9]  # request 2: (1, 2) -> 9 once, its own
    assert drafter.situation([1, 2, 9, 1, 2]) == (2, True)  # its counts alone: agreed
    longer = SuffixDrafter(SuffixConfig(min_n=2, max_n=3, history_tokens=1000))
    propose(longer, [5, 1, 2, 3])  # request 1: (5, 1, 2) -> 3
    longer.reset()
    assert propose(longer, [1, 2, 9, 5, 1, 2], k=1) == [3]  # request 2 has (1, 2) -> 9: the shorter match
    assert propose(SuffixDrafter(SuffixConfig(min_n=2, max_n=3)), [1, 2, 9, 5, 1, 2], k=1) == [9]  # no history


def test_nothing_to_continue_proposes_nothing():
    assert propose(SuffixDrafter(), [1, 2, 3, 4, 5]) == []


def test_earlier_requests_help_later_ones():
    drafter = SuffixDrafter(BIGRAMS)
    propose(drafter, [40, 41, 42, 43, 44])  # request 1
    drafter.reset()
    assert propose(drafter, [5, 6, 40, 41], k=3) == [42, 43, 44]  # request 2 continues request 1's text
    no_history = SuffixDrafter(SuffixConfig(min_n=2, max_n=2, history_tokens=0))
    propose(no_history, [40, 41, 42, 43, 44])
    no_history.reset()
    assert propose(no_history, [5, 6, 40, 41], k=3) == []
    assert no_history.history.index.counts == {} and no_history.current.counts.keys() == {(5, 6), (6, 40)}  # request 1 forgotten


def test_history_is_bounded_and_forgets_the_oldest_exactly():
    config = SuffixConfig(min_n=2, max_n=3, history_tokens=12)
    drafter = SuffixDrafter(config)
    texts = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(0, 50, 10)]
    for text in texts:
        propose(drafter, text)
        drafter.reset()
    assert drafter.history.size <= 12 and list(drafter.history.texts) == texts[-2:]
    expected = ContinuationCounts(config)
    for text in texts[-2:]:
        expected.add(text)
    assert drafter.history.index.counts == expected.counts
    assert drafter.memory["history_requests"] == 2


def test_forks_share_the_history_and_keep_their_own_request():
    """A batch's slots: a request served by one slot helps the next one served by another."""
    first = SuffixDrafter(BIGRAMS)
    second = first.fork()
    propose(first, [40, 41, 42, 43, 44])  # slot 0 serves a request
    assert propose(second, [5, 6, 40, 41], k=3) == []  # slot 1, meanwhile: not history yet
    first.reset()
    second.reset()
    assert propose(second, [5, 6, 40, 41], k=3) == [42, 43, 44]  # both texts are history now
    assert first.live == [] and first.current.counts == {}  # its own request's index: not shared
    assert first.memory["history_requests"] == second.memory["history_requests"] == 2
    with pytest.raises(ValueError, match="shared history"):
        SuffixDrafter(SuffixConfig(max_n=3), history=first.history)


def test_a_context_that_is_not_an_extension_starts_a_new_request():
    drafter = SuffixDrafter(BIGRAMS)
    propose(drafter, [1, 2, 3, 1, 2])
    propose(drafter, [9, 8])  # a new request without reset(): the old text moves to the history
    assert drafter.live == [9, 8] and list(drafter.history.texts) == [[1, 2, 3, 1, 2]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.lists(st.integers(1, 6), min_size=1, max_size=10))
def test_incremental_counts_equal_counts_from_scratch(tokens, steps):
    config = SuffixConfig(min_n=1, max_n=3)
    drafter = SuffixDrafter(config)
    end = 0
    for step in steps * 10:
        end = min(len(tokens), end + step)
        propose(drafter, tokens[:end])
        if end == len(tokens):
            break
    propose(drafter, tokens)
    scratch = ContinuationCounts(config)
    scratch.add(tokens)
    assert drafter.current.counts == scratch.counts
    # a drafter that saw the same prompt (the first context; renames are learned from what follows it)
    # and then the rest in one piece drafts the same
    fresh = SuffixDrafter(config)
    propose(fresh, tokens[:min(len(tokens), steps[0])])
    assert drafter.continuation(tokens, (), 5) == fresh.propose(tokens, 5, GREEDY, torch.Generator()).tokens


def test_bad_config():
    with pytest.raises(ValueError, match="min_n"):
        SuffixConfig(min_n=4, max_n=2)
    with pytest.raises(ValueError, match="min_score"):
        SuffixConfig(min_score=0)
    with pytest.raises(ValueError, match="history_tokens"):
        SuffixConfig(history_tokens=-1)
    for field, value in (("min_n", 1.5), ("max_n", float("inf")), ("max_proposal", None),
                         ("history_tokens", True), ("min_score", "0.3")):
        with pytest.raises(ValueError, match=field):
            SuffixConfig(**{field: value})


# (1, 2) -> 7 twice, 9 once (the latest); after 7: 8 1 (certain); after 9: 5 1 (certain)
BRANCHING = [1, 2, 7, 8, 1, 2, 7, 8, 1, 2, 9, 5, 1, 2]


def test_a_tree_adds_the_other_continuations_best_first_as_branches():
    proposal = SuffixDrafter(BIGRAMS, tree=3).propose(BRANCHING, 3, GREEDY, torch.Generator())
    # the chain 9 5 1 (the latest), then the branch the text also took: 7 (beside 9), 8 below it, 1 below that
    assert proposal.tokens == [9, 5, 1, 7, 8, 1]
    assert proposal.parents == [-1, 0, 1, -1, 3, 4]
    assert proposal.q is None and proposal.gains == pytest.approx([2 / 3] * 3)
    assert proposal.keep_alternatives(1).tokens == [9, 5, 1, 7] and proposal.keep_alternatives(0).parents is None
    # no deeper than k: with k = 1 the branch is the sibling alone
    shallow = SuffixDrafter(BIGRAMS, tree=3).propose(BRANCHING, 1, GREEDY, torch.Generator())
    assert (shallow.tokens, shallow.parents) == ([9, 7], [-1, -1])
    # tree=0, or a text that never branched, gives the chain
    assert SuffixDrafter(BIGRAMS).propose(BRANCHING, 3, GREEDY, torch.Generator()).parents is None
    assert SuffixDrafter(BIGRAMS, tree=3).propose([1, 2, 7, 8, 1, 2], 3, GREEDY, torch.Generator()).parents is None


def test_branches_below_the_min_score_are_not_offered():
    # (1, 2) -> 9 three times (the latest among them), 7 once: the branch 7 scores 1/4
    context = [1, 2, 7, 8, 1, 2, 9, 5, 1, 2, 9, 5, 1, 2, 9, 5, 1, 2]
    strict = SuffixConfig(min_n=2, max_n=2, min_score=0.3)
    assert SuffixDrafter(strict, tree=3).propose(context, 3, GREEDY, torch.Generator()).tokens == [9, 5, 1]
    lenient = SuffixConfig(min_n=2, max_n=2, min_score=0.2)
    assert SuffixDrafter(lenient, tree=3).propose(context, 3, GREEDY, torch.Generator()).tokens == [9, 5, 1, 7, 8, 1]


def test_keeping_alternatives_renumbers_parents_and_keeps_every_parent():
    from specdecode.drafters.protocol import Proposal
    # chain a b; alternatives c (beside a, gain 0.1), d (beside b, 0.5), e (below d, 0.4)
    tree = Proposal([1, 2, 3, 4, 5], None, parents=[-1, 0, -1, 0, 3], gains=[0.1, 0.5, 0.4])
    kept = tree.keep_alternatives(2)
    assert (kept.tokens, kept.parents, kept.gains) == ([1, 2, 4, 5], [-1, 0, 0, 2], [0.5, 0.4])
    with pytest.raises(ValueError, match="parent was dropped"):  # a child worth more than its parent
        Proposal([1, 2, 3], None, parents=[-1, -1, 1], gains=[0.1, 0.5]).keep_alternatives(1)


def test_bad_tree():
    with pytest.raises(ValueError, match="tree"):
        SuffixDrafter(tree=-1)
