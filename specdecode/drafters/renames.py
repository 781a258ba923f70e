"""Renames an edit makes, learned from the output as it is written, so that a copy can go on past them.

When the answer is an edited copy of a text in the prompt ("rename xs to values"), prompt lookup
copies the old text until the first renamed token, and after the new name its tail (`values`)
matches nothing in the prompt: the copy stops at every occurrence. A rename shows itself as the
output repeating a context of the prompt with one token changed:

    prompt:  a1 a2 d b1 b2        output:  a1 a2 c b1 b2        (c != d)   =>   d -> c

(a gapped 4-gram: two tokens each side). From then on lookup also reads the context's tail with c
taken back to d (so it finds the old text; the longer match wins) and writes d as c in what it copies.
A context that the prompt itself fills with different middles (`def add(self` and `def remove(self`)
teaches nothing: such a change is what the text does anyway, not an edit. Where the output keeps d in a context the prompt
had d in, d -> c is dropped (the rename is not everywhere) until the output renames d again.

Only drafts change: they are deterministic and verified like every other draft, so the output law
is untouched (a wrong rename costs a rejected draft, nothing more).
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

_AMBIGUOUS = -1  # a gapped context the prompt fills with more than one middle token (token ids are >= 0)


class Renames:
    """d -> c token renames of an edited copy, learned from a prompt and the output that follows it.
    One to one: a token is renamed to one token, no two tokens to the same, and a rename's target is
    never itself renamed (so reading back, c -> d, is unambiguous)."""

    def __init__(self) -> None:
        self.length = 0  # tokens seen
        self.prompt_length: int | None = None  # fixed by the first `extend`: the prompt
        self._recent: list[int] = []  # the last four tokens seen (all a gapped 4-gram needs)
        self._middle: dict[tuple[int, int, int, int], int] = {}  # (a1, a2, b1, b2) -> the prompt's d
        self.renames: dict[int, int] = {}  # d -> c
        self._back: dict[int, int] = {}  # c -> d

    def extend(self, tokens: Sequence[int]) -> None:
        """Add tokens: the first call's are the prompt, every later call's the output's."""
        first = self.prompt_length is None
        if first:
            self.prompt_length = len(tokens)
        for token in tokens:  # `token` ends a gapped 4-gram a1 a2 _ b1 b2 at position self.length
            i, window = self.length, self._recent + [token]
            self.length += 1
            self._recent = window[-4:]
            if len(window) < 5:
                continue
            key, middle = (window[0], window[1], window[3], window[4]), window[2]
            if first:  # the prompt's contexts (ambiguous ones marked)
                self._middle[key] = middle if self._middle.get(key, middle) == middle else _AMBIGUOUS
            elif i - 2 >= self.prompt_length:  # an output's middle token against the prompt's
                self._learn(self._middle.get(key), middle)

    def _learn(self, old: int | None, new: int) -> None:
        if old is None or old == _AMBIGUOUS:
            return
        if old == new:  # the output kept the old token here: not a rename everywhere (until it renames again)
            if old in self.renames:
                del self._back[self.renames.pop(old)]
        elif old not in self._back and new not in self.renames and self._back.get(new, old) == old:
            if old in self.renames:  # renamed again: the latest wins
                del self._back[self.renames[old]]
            self.renames[old] = new
            self._back[new] = old

    def back(self, token: int) -> int:
        """The token as the prompt had it (c -> d; others unchanged)."""
        return self._back.get(token, token)

    def apply(self, tokens: Sequence[int]) -> list[int]:
        """Copied tokens as the output writes them (d -> c)."""
        return [self.renames.get(x, x) for x in tokens]

    def __bool__(self) -> bool:
        return bool(self.renames)


def new_renames(enabled: bool) -> "Renames | None":
    """A fresh Renames for a new request where the drafter's config learns renames, else None."""
    return Renames() if enabled else None


def longer_match(renames: "Renames | None", tail: Sequence[int],
                 match: Callable[[Sequence[int]], tuple[int, T | None]]) -> tuple[int, T | None]:
    """`match(tail)` ((n, what matched), (0, None) for none), or, where the tail holds renamed tokens,
    `match` of the tail read as the prompt had it if that match is at least as long (a tie: the old
    text, which the copy continues)."""
    found = match(tail)
    if renames:
        old = [renames.back(x) for x in tail]
        if old != list(tail) and (other := match(old))[1] is not None and other[0] >= found[0]:
            return other
    return found
