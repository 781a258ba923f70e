"""Suffix drafting: continue the context the way the text seen so far continued it, as sure as its counts.

The chain form of SuffixDecoding (Oliaro et al., NeurIPS 2025). It counts every continuation of
every n-gram (n = min_n..max_n) in two indexes, as SuffixDecoding keeps a per-request tree beside a
global one: the current request's text (its prompt and the output so far), and the texts of earlier
requests in this process (a bounded history). It drafts greedily:

    match the longest tail of the context that either index has seen (up to max_n tokens; a tie
    goes to the current request); draft the continuation x that followed it most recently, or,
    where that would take the score below min_score, the most frequent one;
    score *= count(x) / count(all continuations); stop when the score falls below min_score
    (an uncertain path) or at k tokens.

The latest continuation, not the most frequent: an edited file's conversation holds every earlier
version, and the next answer repeats the latest one. On the recorded editing session
(benchmarks/session.py, turns 2-4, replayed at the measured pass costs) the most frequent
continuation over one index of both texts gave 2.61x plain decoding, the latest 2.80x, and with the
current request before the history 2.86x (prompt lookup 2.79x); on the bench's prompts the three
differ by under 1%. The counts still set the score, so the draft is long where the text is being
copied and short or empty where it branches (SuffixDecoding's adaptive draft length); adaptive K
still caps it by cost.

Draft tree (optional, `tree` > 0 extra nodes): the other continuations the text had at each
position of the chain become branches beside it, and theirs below them, best score first
(SuffixDecoding's tree): a branch is the probability-weighted "or it went like that before".
A node's score never exceeds its parent's, so taking the best-scored nodes first keeps every
kept node's parent. The cost model decides how many of them pay, as for the draft model's tree.

Renames an edit makes (`xs` to `values`) are learned from the output and copied past, as prompt
lookup does (drafters/renames.py): a tail holding a renamed token is also matched as the prompt had
it, and drafted tokens are written renamed.

Deterministic (q = None, one-hot), so exact like every drafter. Cross-request history
changes which drafts are made, never the output law; what a seed reproduces then also
depends on the requests before it in the process (`history_tokens=0` turns it off).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode.checks import integer, real, require_integers
from specdecode.core.probs import SamplingParams
from specdecode.drafters.protocol import Drafter, Proposal
from specdecode.drafters.renames import longer_match, new_renames


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    min_n: int = 2  # shortest tail worth matching
    max_n: int = 8  # longest tail matched (a longer match has more specific counts)
    min_score: float = 0.25  # stop drafting when the draft's estimated probability falls below this
    max_proposal: int = 16
    history_tokens: int = 65_536  # tokens of earlier requests kept (oldest forgotten first; 0 = none)
    renames: bool = True  # learn an edit's token renames from the output (drafters/renames.py)

    def __post_init__(self) -> None:
        require_integers(self, "min_n", "max_n", "max_proposal", "history_tokens")
        if real(self.min_score) is None:
            raise ValueError(f"min_score must be a number in (0, 1], got {self.min_score!r}")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if not 0 < self.min_score <= 1:
            raise ValueError(f"min_score must be in (0, 1], got {self.min_score}")
        if not isinstance(self.renames, bool):
            raise ValueError(f"renames must be True or False, got {self.renames!r} ({type(self.renames).__name__})")
        if self.max_proposal < 1 or self.history_tokens < 0:
            raise ValueError("max_proposal must be >= 1 and history_tokens >= 0")


class ContinuationCounts:
    """For every n-gram (min_n <= n <= max_n): how often each token followed it, over the texts added.
    Each n-gram's continuations are kept in order of their latest addition: the last one is the
    continuation of its most recent occurrence (the one prompt lookup copies)."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.counts: dict[tuple[int, ...], Counter] = {}

    def add(self, tokens: Sequence[int], start: int = 0, sign: int = 1) -> None:
        """Count (sign=1) or uncount (sign=-1) the continuations tokens[e + 1] for every end e >= start - 1
        of an n-gram, i.e. those that the tokens from `start` on complete."""
        for nxt in range(max(1, start), len(tokens)):
            for n in range(self.config.min_n, min(self.config.max_n, nxt) + 1):
                key, token = tuple(tokens[nxt - n: nxt]), tokens[nxt]
                counter = self.counts.setdefault(key, Counter())
                if sign > 0:
                    counter[token] = counter.pop(token, 0) + sign  # re-inserted: now the most recent
                elif counter[token] > -sign:
                    counter[token] += sign  # forgetting an old text keeps the recency order
                else:
                    del counter[token]
                    if not counter:
                        del self.counts[key]

    def match(self, tail: Sequence[int]) -> tuple[int, Counter | None]:
        """(n, its continuation counts) for the longest n-gram ending `tail` that has any; (0, None) if none."""
        for n in range(min(self.config.max_n, len(tail)), self.config.min_n - 1, -1):
            counter = self.counts.get(tuple(tail[len(tail) - n:]))
            if counter:
                return n, counter
        return 0, None


class History:
    """Earlier requests' texts, counted in one index; beyond `history_tokens` tokens the oldest leave.
    A drafter and its forks (the batch's slots) share one, so every slot learns from every request the
    process served, whichever slot served it (the scheduler gives a new request the free slot whose
    cache shares most of its prompt, else the first free one, so a repeated request seldom lands where
    the first one ran). Safe unlocked: the engine drives all slots from one thread."""

    def __init__(self, config: SuffixConfig) -> None:
        self.config = config
        self.index = ContinuationCounts(config)
        self.texts: deque[list[int]] = deque()
        self.size = 0  # tokens in `texts`

    def add(self, text: list[int]) -> None:
        if not self.config.history_tokens or not text:
            return
        self.texts.append(text)
        self.size += len(text)
        self.index.add(text)
        while self.size > self.config.history_tokens:
            old = self.texts.popleft()
            self.index.add(old, sign=-1)
            self.size -= len(old)


class SuffixDrafter(Drafter):
    """Drafter over ContinuationCounts of the current request and of a bounded history of earlier ones."""

    free = True  # no model; q one-hot (drafters/protocol.py)

    def __init__(self, config: SuffixConfig = SuffixConfig(), tree: int = 0, history: History | None = None) -> None:
        if integer(tree) is None or tree < 0:
            raise ValueError(f"tree must be an integer >= 0 (extra tree nodes per round; 0 = a chain), got {tree!r}")
        if history is not None and history.config != config:
            raise ValueError("a shared history must be counted with the drafter's own config")
        self.config = config
        self.tree = tree
        self.name = "suffix"
        self.current = ContinuationCounts(config)  # the current request's text, counted up to its end
        self.history = history if history is not None else History(config)  # shared with forks
        self.live: list[int] = []  # the current request's text
        self.renames = new_renames(config.renames)  # the current request's

    def reset(self) -> None:
        """A new request: the current one's text joins the history (the oldest beyond the bound leaves)."""
        self.history.add(self.live)
        self.current = ContinuationCounts(self.config)
        self.live = []
        self.renames = new_renames(self.config.renames)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Proposal:
        self._sync(context)
        k = min(k, self.config.max_proposal)
        steps = self._walk(self.live[-self.config.max_n:], k)
        if self.tree and steps:
            return self._with_branches(steps, k)
        return Proposal([token for token, _, _ in steps], None)

    def continuation(self, context: Sequence[int], path: Sequence[int], k: int) -> list[int]:
        """The chain after context + path (path: draft tokens; only the context is counted)."""
        self._sync(context)
        tail = (self.live[-self.config.max_n:] + list(path))[-self.config.max_n:]
        return [token for token, _, _ in self._walk(tail, min(k, self.config.max_proposal))]

    def situation(self, context: Sequence[int]) -> tuple[int, bool] | None:
        """The class of this round's first draft, for adaptive K to keep acceptance evidence per
        class: the matched tail's length in classes 2-3, 4-7 and 8+ (its number of bits, with the
        default max_n = 8), and whether every counted continuation agreed (None: no match). Offline
        on the embedded pair's greedy outputs the first draft was accepted 31-54% of the time after a
        2-token match and 76-95% after 8; 52-85% where the counts agreed and 10-31% where they split
        (measured with the most frequent continuation; at every position of the Intel VM's recorded bench
        outputs the latest continuation's acceptance per class was the same to 0.02, and 9-22% where split)."""
        self._sync(context)
        n, counter = self._next(self.live[-self.config.max_n:])
        if counter is None:
            return None
        return n.bit_length(), len(counter) == 1

    def _sync(self, context: Sequence[int]) -> None:
        """Count the context's new tokens (a context that does not extend the live text starts a request)."""
        if len(context) < len(self.live) or (self.live and context[len(self.live) - 1] != self.live[-1]):
            self.reset()  # not an extension of what we indexed: a new request without reset()
        start = len(self.live)
        self.live.extend(context[start:])
        self.current.add(self.live, start)
        if self.renames is not None:
            self.renames.extend(context[start:])  # the first call after a reset: the prompt

    def _match(self, tail: Sequence[int]) -> tuple[int, Counter | None]:
        """The longest match for `tail`, or for `tail` read as the prompt had it where it holds renamed
        tokens (the longer; a tie: the prompt's reading), in the current request's text or else in the
        history (the longer; a tie: the current request). Its continuations are counted as the text had
        them (`_next` writes them as the output does)."""
        here = longer_match(self.renames, tail, self.current.match)
        before = longer_match(self.renames, tail, self.history.index.match)
        return here if here[0] >= before[0] else before

    def _next(self, tail: Sequence[int]) -> tuple[int, Counter | None]:
        """`_match` for `tail`: the match's length and its continuation counts, each token written as
        the output writes it (a renamed token's counts merged into its new name's)."""
        n, counter = self._match(tail)
        if counter is None or not self.renames or not any(token in self.renames.renames for token in counter):
            return n, counter
        renamed: Counter = Counter()
        for token, count in counter.items():  # re-inserted as `ContinuationCounts.add` does: a merged
            token = self.renames.renames.get(token, token)  # token sits where its latest part sat
            renamed[token] = renamed.pop(token, 0) + count  # (the latest continuation stays last)
        return n, renamed

    def _walk(self, tail: list[int], k: int) -> list[tuple[int, list[int], float]]:
        """Greedy steps from `tail`: (token, the tail it continues, the score before it) each."""
        steps: list[tuple[int, list[int], float]] = []
        score = 1.0
        while len(steps) < k:
            counter = self._next(tail)[1]
            if counter is None:
                break
            total = sum(counter.values())
            token = next(reversed(counter))  # the latest continuation (ContinuationCounts keeps the order),
            if score * counter[token] / total < self.config.min_score:  # unless that one is too unlikely:
                token = max(reversed(counter.items()), key=lambda item: item[1])[0]  # the most frequent
            if score * counter[token] / total < self.config.min_score:
                break
            steps.append((token, tail, score))
            score *= counter[token] / total
            tail = self._extend(tail, token)
        return steps

    def _extend(self, tail: list[int], token: int) -> list[int]:
        return (tail[1:] if len(tail) >= self.config.max_n else tail) + [token]

    def _with_branches(self, steps: list[tuple[int, list[int], float]], k: int) -> Proposal:
        """The chain (nodes 0..K-1) plus up to `tree` branch nodes, best score first: the chain's
        other continuations at each depth, then theirs, no deeper than k."""
        tokens = [token for token, _, _ in steps]
        parents, gains = list(range(-1, len(tokens) - 1)), []
        frontier: list[tuple[float, int, int, int, list[int], int]] = []  # (-score, order, parent, depth, tail, token)
        order = itertools.count()  # ties: the earlier offered (the chain's shallower depths first)

        def offer(parent: int, depth: int, tail: list[int], score: float, skip: int | None) -> None:
            counter = self._next(tail)[1] if depth <= k else None
            total = sum(counter.values()) if counter else 0
            for token, count in (counter or {}).items():
                if token != skip and score * count / total >= self.config.min_score:
                    heapq.heappush(frontier, (-score * count / total, next(order), parent, depth, tail, token))

        for i, (token, tail, score) in enumerate(steps):
            offer(i - 1, i + 1, tail, score, skip=token)
        while frontier and len(gains) < self.tree:
            neg_score, _, parent, depth, tail, token = heapq.heappop(frontier)
            tokens.append(token)
            parents.append(parent)
            gains.append(-neg_score)
            offer(len(tokens) - 1, depth + 1, self._extend(tail, token), -neg_score, skip=None)
        if not gains:
            return Proposal(tokens, None)
        return Proposal(tokens, None, parents=parents, gains=gains)

    def fork(self) -> "SuffixDrafter":
        """Another slot's drafter: its own request's index, the same history (`History`)."""
        return SuffixDrafter(self.config, self.tree, self.history)

    def observe(self, drafted: int, accepted: int) -> None:
        pass

    @property
    def memory(self) -> dict:
        """What the two indexes hold (this request's and the shared history's; an n-gram in both is held,
        and counted, twice): n-grams, counted continuations, tokens and requests of history."""
        indexes = (self.current.counts, self.history.index.counts)
        return {"ngrams": sum(map(len, indexes)),
                "continuations": sum(len(c) for counts in indexes for c in counts.values()),
                "history_tokens": self.history.size, "history_requests": len(self.history.texts)}
