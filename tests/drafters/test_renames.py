"""Renames learned from the output (drafters/renames.py) and prompt lookup copying past them."""

import random

import pytest
import torch

from specdecode.backends.protocol import Model
from specdecode.core.probs import GREEDY
from specdecode.drafters.lookup import LookupConfig, LookupDrafter, lookup
from specdecode.drafters.renames import Renames
from specdecode.engine.config import GenerationConfig
from specdecode.engine.engine import generate_tokens
from specdecode.engine.policy import FixedK
from specdecode.engine.stats import GenerationStats

CFG = LookupConfig(min_n=2, max_n=3, max_proposal=8)
OFF = LookupConfig(min_n=2, max_n=3, max_proposal=8, renames=False)
D, C = 5, 7  # the prompt's token and the output's rename of it
# two lines of a "file" in the prompt, each holding D: 10 11 D 12 13 / 20 21 D 22 23 30
PROMPT = [10, 11, D, 12, 13, 20, 21, D, 22, 23, 30]


def renames_after(prompt, output):
    r = Renames()
    r.extend(prompt)
    for token in output:  # the output arrives a token at a time, as it is decoded
        r.extend([token])
    return r.renames


def test_a_changed_middle_in_a_prompt_context_is_a_rename():
    assert renames_after(PROMPT, [10, 11, C, 12]) == {}  # b2 not written yet: nothing known
    assert renames_after(PROMPT, [10, 11, C, 12, 13]) == {D: C}


def test_the_prompt_alone_teaches_nothing():
    assert renames_after(PROMPT + [10, 11, C, 12, 13], []) == {}


def test_a_context_the_prompt_fills_two_ways_teaches_nothing():
    """`def add(self` and `def remove(self` in the prompt: the output's `def get(self` is no rename."""
    prompt = [10, 11, 1, 12, 13, 10, 11, 2, 12, 13]
    assert renames_after(prompt, [10, 11, 3, 12, 13]) == {}
    assert renames_after(prompt[:5], [10, 11, 3, 12, 13]) == {1: 3}  # control: one way, a rename


def test_a_rename_is_dropped_where_the_output_keeps_the_old_token():
    assert renames_after(PROMPT, [10, 11, C, 12, 13, 20, 21, D, 22, 23]) == {}


def test_lookup_copies_past_a_learned_rename():
    out = [10, 11, C, 12, 13, 20, 21]
    assert lookup(PROMPT + out, 4, CFG, prompt_length=len(PROMPT)) == [C, 22, 23, 30]  # written renamed
    assert lookup(PROMPT + out, 4, OFF, prompt_length=len(PROMPT)) == [D, 22, 23, 30]
    out += [C]  # the tail (21, C) is nowhere in the text; as the prompt had it, (21, D) is
    assert lookup(PROMPT + out, 3, CFG, prompt_length=len(PROMPT)) == [22, 23, 30]
    assert lookup(PROMPT + out, 3, OFF, prompt_length=len(PROMPT)) == []
    assert lookup(PROMPT + out, 3, CFG) == []  # all of it prompt: no output, no renames


def test_the_match_length_reads_renamed_tokens_as_the_prompt_had_them():
    out = [10, 11, C, 12, 13, 20, 21, C]  # as the prompt had it: its first 8 tokens
    for renames, length in ((True, 8), (False, 0)):
        drafter = LookupDrafter(LookupConfig(min_n=2, max_n=3, long_match=16, renames=renames))
        drafter.situation(PROMPT)  # the first context a drafter sees after a reset is the prompt
        for n in range(1, len(out) + 1):
            situation = drafter.situation(PROMPT + out[:n])
        assert drafter.index.match_length(16) == length and (situation is None) == (length == 0)


def test_the_drafter_fed_piece_by_piece_equals_the_pure_function():
    """The incremental drafter (prompt first, then the output in pieces) proposes what `lookup`
    proposes from scratch with the same prompt length; renames must actually occur in these cases."""
    rng = random.Random(0)
    learned = 0
    for _ in range(300):
        prompt = [rng.randrange(12) for _ in range(rng.randrange(4, 40))]
        start = rng.randrange(len(prompt))
        # an edited copy of part of the prompt: some tokens changed, then anything
        output = [rng.randrange(14) if rng.random() < 0.2 else t for t in prompt[start:]] + \
            [rng.randrange(14) for _ in range(rng.randrange(0, 10))]
        seen = False
        drafter = LookupDrafter(CFG)
        context = list(prompt)
        assert drafter.propose(context, 4, GREEDY, torch.Generator()).tokens == \
            lookup(context, 4, CFG, prompt_length=len(prompt))
        pos = 0
        while pos < len(output):
            step = rng.randrange(1, 5)
            context += output[pos: pos + step]
            pos += step
            assert drafter.propose(context, 4, GREEDY, torch.Generator()).tokens == \
                lookup(context, 4, CFG, prompt_length=len(prompt))
            seen = seen or bool(drafter.index.renames)
        learned += seen
    assert learned >= 30, learned


class ScriptTarget(Model):
    """A target whose greedy choice after position i is script[i + 1], whatever was fed (a recorded
    greedy output played back: a draft is judged against the script at its position)."""

    def __init__(self, script):
        self.script, self.vocab_size, self.max_length, self.length = script, max(script) + 1, len(script) + 64, 0

    def forward(self, tokens, n_logits=1):
        self.length += len(tokens)
        logits = torch.full((n_logits, self.vocab_size), -1e9)
        for row, position in enumerate(range(self.length - n_logits, self.length)):
            logits[row, self.script[min(position + 1, len(self.script) - 1)]] = 0.0
        return logits

    def truncate(self, length):
        self.length = length


def test_a_renaming_edit_takes_fewer_rounds_and_is_the_same_output():
    """The engine on an edit that renames one token everywhere in a 12-line file: the same output
    (greedy: the script), in fewer rounds with renames learned than without, drafting K = 8."""
    rng = random.Random(1)
    lines = [[100 + rng.randrange(50) for _ in range(3)] + [D] + [150 + rng.randrange(50) for _ in range(4)]
             for _ in range(12)]
    prompt = [1] + [t for line in lines for t in line] + [2]
    output = [C if t == D else t for line in lines for t in line]
    rounds = {}
    for name, config in (("on", LookupConfig()), ("off", LookupConfig(renames=False))):
        stats = GenerationStats()
        emitted = [t for rnd in generate_tokens(ScriptTarget(prompt + output), [LookupDrafter(config)], prompt,
                                                GenerationConfig(max_new_tokens=len(output)), frozenset(), stats,
                                                FixedK(8)) for t in rnd.tokens]
        assert emitted == output
        assert max(r.drafted for r in stats.rounds) == 8
        rounds[name] = len(stats.rounds)
    assert rounds["on"] < 0.6 * rounds["off"], rounds


def test_the_suffix_drafter_copies_past_a_learned_rename_too():
    from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
    out = [10, 11, C, 12, 13, 20, 21, C]
    for config, expected in ((SuffixConfig(history_tokens=0), [22, 23, 30]),
                             (SuffixConfig(history_tokens=0, renames=False), [])):
        drafter = SuffixDrafter(config)
        drafter.propose(PROMPT, 4, GREEDY, torch.Generator())  # the first context after a reset: the prompt
        for n in range(1, len(out) + 1):
            proposal = drafter.propose(PROMPT + out[:n], 4, GREEDY, torch.Generator())
        assert proposal.tokens[:3] == expected
    drafter = SuffixDrafter(SuffixConfig(history_tokens=0))
    drafter.propose(PROMPT, 4, GREEDY, torch.Generator())
    for n in range(1, 8):
        proposal = drafter.propose(PROMPT + out[:n], 4, GREEDY, torch.Generator())
    assert proposal.tokens[:1] == [C]  # after 20 21 the prompt had D: written as the output writes it


def test_the_suffix_situation_sees_the_counts_as_the_drafts_do():
    """After a rename, D and C continuing the same context are one continuation: the counts agree."""
    from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
    drafter = SuffixDrafter(SuffixConfig(history_tokens=0))
    drafter.propose(PROMPT, 4, GREEDY, torch.Generator())
    context = PROMPT + [10, 11, C, 12, 13, 10, 11]  # (10, 11) was followed by D, then by C: renamed, one
    assert drafter.situation(context) == (2, True)
    assert drafter.propose(context, 3, GREEDY, torch.Generator()).tokens == [C, 12, 13]
    plain = SuffixDrafter(SuffixConfig(history_tokens=0, renames=False))  # the control: two continuations
    plain.propose(PROMPT, 4, GREEDY, torch.Generator())
    assert plain.situation(context) == (2, False)


def test_the_switch_must_be_a_bool():
    from specdecode.drafters.suffix import SuffixConfig
    for make in (LookupConfig, SuffixConfig):
        with pytest.raises(ValueError, match="renames must be True or False"):
            make(renames="no")


def test_renames_stay_one_to_one_whatever_the_order():
    """Two tokens renamed to one, or a chain d -> c -> e, would make reading back ambiguous: refused."""
    prompt = [10, 11, 3, 12, 13, 20, 21, 8, 22, 23, 30, 31, 99, 32, 33]
    assert renames_after(prompt, [10, 11, 99, 12, 13, 20, 21, 99, 22, 23]) == {3: 99}  # 8 -> 99 refused
    assert renames_after(prompt, [30, 31, 40, 32, 33, 10, 11, 99, 12, 13]) == {99: 40}  # 3 -> 99 refused
    assert renames_after(prompt, [10, 11, 99, 12, 13, 30, 31, 40, 32, 33]) == {3: 99}  # 99 -> 40 refused


def test_a_longer_match_on_the_output_beats_a_shorter_one_read_back():
    """The output wrote 40 11 C 50 51 52 itself: after 40 11 C it goes on with 50, not with the
    prompt's 12 (whose read-back match, 11 D, is shorter)."""
    cfg = LookupConfig(min_n=2, max_n=3, max_proposal=8)
    out = [10, 11, C, 12, 13, 40, 11, C, 50, 51, 52, 40, 11, C]
    assert lookup(PROMPT + out, 3, cfg, prompt_length=len(PROMPT)) == [50, 51, 52]
    assert lookup(PROMPT + out[:-3] + [20, 21, C], 3, cfg, prompt_length=len(PROMPT)) == [22, 23, 30]


def test_prompt_length_is_checked():
    for bad in (-1, len(PROMPT) + 1, 2.5, "x"):
        with pytest.raises(ValueError, match="prompt_length must be an integer"):
            lookup(PROMPT, 3, CFG, prompt_length=bad)


def test_a_new_context_without_reset_starts_over():
    """Direct use: a context that does not extend the indexed one is a new request, not more output."""
    drafter = LookupDrafter(CFG)
    drafter.situation(PROMPT)
    drafter.situation(PROMPT + [10, 11, C, 12, 13])
    assert drafter.index.renames.renames == {D: C}
    fresh = [1] + PROMPT + [10, 11, C, 12, 13]  # longer, but not an extension: its own prompt
    drafter.situation(fresh)
    assert drafter.index.renames.renames == {} and drafter.index.renames.prompt_length == len(fresh)


def test_suffix_merged_counts_keep_the_latest_continuation_last():
    """A renamed token's count merges into its new name's, at the place of the latest of them."""
    from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
    drafter = SuffixDrafter(SuffixConfig(history_tokens=0))
    drafter.propose(PROMPT, 1, GREEDY, torch.Generator())
    drafter.propose(PROMPT + [10, 11, C, 12, 13], 1, GREEDY, torch.Generator())
    # after (1, 2) the text had: D (oldest), 9, 9, C (latest): D and C merge into C, 2 against 9's 2
    drafter.current.counts[(1, 2)] = __import__("collections").Counter({D: 1, 9: 2, C: 1})
    assert list(drafter._next([1, 2])[1].items()) == [(9, 2), (C, 2)]
    assert drafter._walk([1, 2], 1)[0][0] == C  # the latest, renamed


def test_suffix_tree_branches_are_written_renamed_and_distinct():
    """The suffix drafter's tree with renames: every node renamed, no two siblings the same token."""
    from specdecode.drafters.suffix import SuffixConfig, SuffixDrafter
    prompt = [10, 11, D, 12, 13, 20, 21, D, 22, 23, 30, 20, 21, D, 24, 25, 31, 20, 21, 6, 22, 23]
    drafter = SuffixDrafter(SuffixConfig(history_tokens=0, min_score=0.1), tree=6)
    drafter.propose(prompt, 4, GREEDY, torch.Generator())
    out = [10, 11, C, 12, 13, 99, 20, 21]  # after 20 21 the prompt had D twice and 6 once, then 22 or 24
    for n in range(1, len(out) + 1):
        proposal = drafter.propose(prompt + out[:n], 4, GREEDY, torch.Generator())
    assert proposal.parents is not None and len(proposal.tokens) > 4  # a tree, with branches
    assert D not in proposal.tokens and C in proposal.tokens
    children = {}
    for token, parent in zip(proposal.tokens, proposal.parents):
        children.setdefault(parent, []).append(token)
    assert all(len(set(c)) == len(c) for c in children.values()), children
