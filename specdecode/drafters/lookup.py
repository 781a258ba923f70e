"""Prompt-lookup (n-gram) drafting: copy what followed the last time the context's tail appeared.

No model and no training: the drafter matches the longest suffix of the context
(between min_n and max_n tokens) against earlier text and proposes the tokens that
followed its most recent earlier occurrence. Code editing, quoting and repetitive
output make this cheap guess right surprisingly often.

It is a deterministic drafter: its q is one-hot (`Proposal.q = None`), verified by
the same rule as everything else, so it is exact for greedy and sampling alike.

`NgramIndex` is updated incrementally as the context grows (each new token adds
max_n - min_n + 1 entries), so a round costs O(max_n), not a scan of the context.

An edit that renames something (`xs` to `values`) breaks a plain copy at every occurrence; the
drafter learns such renames from its output (drafters/renames.py) and copies past them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdecode.checks import integer, real, require_integers
from specdecode.core.probs import SamplingParams
from specdecode.drafters.protocol import Drafter, Proposal, Situation
from specdecode.drafters.renames import Renames, longer_match, new_renames


@dataclass(frozen=True, slots=True)
class LookupConfig:
    min_n: int = 2  # shortest suffix worth matching
    max_n: int = 4  # longest suffix tried (longest match wins)
    max_proposal: int = 16  # never propose more than this many tokens (adaptive K's k_max)
    long_match: int = 16  # matches this long and longer are one class for adaptive K (`situation`)
    # (m, alpha): the first copied token's acceptance after a match of m or more tokens, adaptive K's
    # prior for a class before the request gives evidence for it. Measured on the embedded pair's
    # greedy outputs of all 24 bench prompts (code generation, code editing, chat; 160 tokens each;
    # benchmarks/lookup_bound.py): 0.50, 0.70, 0.85 and 0.96 after 2-3, 4-7, 8-15 and 16+ tokens;
    # each half of the prompts gave the same to 0.03. A neutral prior (0.5 for every class) left the
    # 16+ class undrafted for a request's first rounds: 4.6% slower on code editing (replayed).
    match_priors: tuple[tuple[int, float], ...] = ((2, 0.50), (4, 0.70), (8, 0.85), (16, 0.96))
    # learn an edit's token renames from the output and copy past them (drafters/renames.py). In the
    # multi-turn editing session (benchmarks/session.py, Intel VM) the two rename turns went from 1.89x
    # and 1.60x plain decoding to 2.75x and 2.95x, the rest unchanged; replayed on the bench's code-editing
    # outputs (lookup_bound.py --replay) 1.314x -> 1.307x: two one-off changes were taken for renames
    renames: bool = True

    def __post_init__(self) -> None:
        require_integers(self, "min_n", "max_n", "max_proposal", "long_match")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.max_proposal < 1:
            raise ValueError(f"max_proposal must be >= 1, got {self.max_proposal}")
        if not isinstance(self.renames, bool):
            raise ValueError(f"renames must be True or False, got {self.renames!r} ({type(self.renames).__name__})")
        if self.long_match < self.max_n:
            raise ValueError(f"long_match must be >= max_n ({self.max_n}), got {self.long_match}")
        try:
            pairs = tuple((integer(m), real(a)) for m, a in self.match_priors)
            valid = bool(pairs) and all(m is not None and a is not None and 0 < a < 1 for m, a in pairs) \
                and [m for m, _ in pairs] == sorted({m for m, _ in pairs})
        except (TypeError, ValueError):  # not pairs of numbers
            valid = False
        if not valid:
            raise ValueError(f"match_priors must be (length, acceptance) pairs with increasing lengths and "
                             f"acceptances in (0, 1), got {self.match_priors!r}")
        object.__setattr__(self, "match_priors", pairs)  # frozen: normalised once, here (hashable)

    def prior(self, match: int) -> float:
        """The acceptance `match_priors` gives a match of this length (the shortest bound's below it)."""
        return next((a for m, a in reversed(self.match_priors) if m <= match), self.match_priors[0][1])


class NgramIndex:
    """For every n-gram that has a following token: where its most recent occurrence ends. With
    `renames` (fed the same tokens, the first `extend` being the prompt), a tail that holds a renamed
    token is also looked up as the prompt had it, and copies are written with the renames."""

    def __init__(self, config: LookupConfig, renames: Renames | None = None) -> None:
        self.config = config
        self.renames = renames
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        if self.renames is not None:
            self.renames.extend(tokens)
        # an n-gram ending at position e is usable once token e+1 exists
        for end in range(self._indexed, len(self.tokens) - 1):
            for n in range(self.config.min_n, self.config.max_n + 1):
                if end + 1 >= n:
                    self._last_end[tuple(self.tokens[end + 1 - n: end + 1])] = end
        self._indexed = max(self._indexed, len(self.tokens) - 1)

    def last_end(self, ngram: tuple[int, ...]) -> int | None:
        """Where the most recent occurrence of `ngram` that has a following token ends (None: none)."""
        return self._last_end.get(ngram)

    def propose(self, k: int, path: Sequence[int] = ()) -> list[int]:
        """Up to k tokens that followed the longest earlier match of the current suffix (of the
        indexed tokens followed by `path`, draft tokens that are not indexed)."""
        end = self._match(path)
        if end is None:
            return []
        copy = self.tokens[end + 1: min(end + 1 + min(k, self.config.max_proposal), len(self.tokens))]
        return self.renames.apply(copy) if self.renames else copy

    def match_length(self, cap: int) -> int:
        """How many tokens (at most `cap`) the indexed text's suffix shares with the earlier
        occurrence `propose` copies from, counted back past max_n (0: no match). A long shared
        history predicts the copy far better than a 2-token coincidence does."""
        end = self._match(())
        if end is None:
            return 0
        back = self.renames.back if self.renames else (lambda x: x)
        last, m = len(self.tokens) - 1, 0
        while m < cap and end - m >= 0 and back(self.tokens[end - m]) == back(self.tokens[last - m]):
            m += 1
        return m

    def _match(self, path: Sequence[int]) -> int | None:
        """Where the most recent occurrence of the longest matching suffix ends (None: no match); a
        tail holding renamed tokens is also looked up as the prompt had it (`longer_match`)."""
        tail = (self.tokens[-self.config.max_n:] + list(path))[-self.config.max_n:]
        return longer_match(self.renames, tail, self._longest)[1]

    def _longest(self, tail: list[int]) -> tuple[int, int | None]:
        """(n, where the most recent occurrence of the tail's last n tokens ends) for the longest
        n with one; (0, None) if none."""
        for n in range(min(self.config.max_n, len(tail)), self.config.min_n - 1, -1):
            end = self._last_end.get(tuple(tail[len(tail) - n:]))
            if end is not None:
                return n, end
        return 0, None


def lookup(context: Sequence[int], k: int, config: LookupConfig = LookupConfig(),
           prompt_length: int | None = None) -> list[int]:
    """The pure function: what the drafter proposes for this context (built from scratch), of which
    the first `prompt_length` tokens are the prompt (None: all; no output, so no renames learned)."""
    if prompt_length is not None and (integer(prompt_length) is None or not 0 <= prompt_length <= len(context)):
        raise ValueError(f"prompt_length must be an integer in 0..{len(context)} (the context's length) or None, "
                         f"got {prompt_length!r}")
    index = NgramIndex(config, new_renames(config.renames))
    cut = len(context) if prompt_length is None else prompt_length
    index.extend(context[:cut])
    if cut < len(context):
        index.extend(context[cut:])
    return index.propose(k)


class LookupDrafter(Drafter):
    """Drafter adapter around an NgramIndex kept in step with the growing context."""

    free = True  # no model; q one-hot (drafters/protocol.py)

    def __init__(self, config: LookupConfig = LookupConfig()) -> None:
        self.config = config
        self.name = "lookup"
        self.index = self._new_index()

    def _new_index(self) -> NgramIndex:
        return NgramIndex(self.config, new_renames(self.config.renames))

    def reset(self) -> None:
        self.index = self._new_index()

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Proposal:
        return Proposal(self.continuation(context, (), k), None)

    def continuation(self, context: Sequence[int], path: Sequence[int], k: int) -> list[int]:
        """What lookup proposes after context + path (path: draft tokens; only the context is indexed)."""
        self._follow(context)
        return self.index.propose(k, path) if k > 0 else []

    def situation(self, context: Sequence[int]) -> Situation | None:
        """The class of this round's match, for adaptive K to keep acceptance evidence per class:
        its length counted back past max_n, in classes 2-3, 4-7, 8-15 and 16+ (the key is the number
        of bits; None: no match), with the class's measured acceptance as its prior (`match_priors`)."""
        self._follow(context)
        m = self.index.match_length(self.config.long_match)
        return Situation(m.bit_length(), self.config.prior(m)) if m else None

    def _follow(self, context: Sequence[int]) -> None:
        known = self.index.tokens
        if len(context) < len(known) or (known and context[len(known) - 1] != known[-1]):
            self.reset()  # not an extension of what was indexed: a new request without reset()
        self.index.extend(context[len(self.index.tokens):])

    def fork(self) -> "LookupDrafter":
        return LookupDrafter(self.config)

    def observe(self, drafted: int, accepted: int) -> None:
        pass
