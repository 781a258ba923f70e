"""Renames an edit makes, learned from the output as it is written, so that a copy can go on past them.

When the answer is an edited copy of a text in the prompt ("rename xs to values"), prompt lookup
copies the old text until the first renamed token, and after the new name its tail (`values`)
matches nothing in the prompt: the copy stops at every occurrence. A rename shows itself as the
output repeating a context of the prompt with one token changed:

    prompt:  a1 a2 d b1 b2        output:  a1 a2 c b1 b2        (c != d)   =>   d -> c

(a gapped 4-gram: two tokens each side). From then on lookup reads the context's tail with c taken
back to d (so it finds the old text) and writes d as c in what it copies. A context that the prompt
itself fills with different middles (`def add(self` and `def remove(self`) teaches nothing: such a
change is what the text does anyway, not an edit. Where the output keeps d in a context the prompt
had d in, d -> c is dropped (the rename is not everywhere).

Only drafts change: they are deterministic and verified like every other draft, so the output law
is untouched (a wrong rename costs a rejected draft, nothing more).
"""

from __future__ import annotations

from typing import Sequence

_AMBIGUOUS = -1  # a gapped context the prompt fills with more than one middle token (token ids are >= 0)


class Renames:
    """d -> c token renames of an edited copy, learned from a prompt and the output that follows it."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.prompt_length: int | None = None  # fixed by the first `extend`: the prompt
        self._middle: dict[tuple[int, int, int, int], int] = {}  # (a1, a2, b1, b2) -> the prompt's d
        self.renames: dict[int, int] = {}  # d -> c
        self._back: dict[int, int] = {}  # c -> d

    def extend(self, tokens: Sequence[int]) -> None:
        """Add tokens: the first call's are the prompt, every later call's the output's."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        if self.prompt_length is None:
            self.prompt_length = len(self.tokens)
        t = self.tokens
        for i in range(max(start, 4), len(t)):  # i: where a gapped 4-gram a1 a2 _ b1 b2 ends
            key, middle = (t[i - 4], t[i - 3], t[i - 1], t[i]), t[i - 2]
            if i < self.prompt_length:  # the prompt's contexts (ambiguous ones marked)
                self._middle[key] = middle if self._middle.get(key, middle) == middle else _AMBIGUOUS
            elif i - 2 >= self.prompt_length:  # an output's middle token against the prompt's
                self._learn(self._middle.get(key), middle)

    def _learn(self, old: int | None, new: int) -> None:
        if old is None or old == _AMBIGUOUS:
            return
        if old == new:
            self.renames.pop(old, None)  # the output kept the old token here: not a rename everywhere
        elif new not in self.renames:  # no chains (d -> c -> e)
            self.renames[old] = new
        else:
            return
        self._back = {c: d for d, c in self.renames.items()}

    def back(self, token: int) -> int:
        """The token as the prompt had it (c -> d; others unchanged)."""
        return self._back.get(token, token)

    def apply(self, tokens: Sequence[int]) -> list[int]:
        """Copied tokens as the output writes them (d -> c)."""
        return [self.renames.get(x, x) for x in tokens]

    def __bool__(self) -> bool:
        return bool(self.renames)
