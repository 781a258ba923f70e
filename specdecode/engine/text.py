"""The text layer: a request's tokens as text, streamed, with its stop strings applied.

Tokens arrive round by round; text leaves in whole characters (a UTF-8 character split across
tokens shows with the token completing it), holding back whatever may yet become a stop string.
A stop string ends the output: the engine finishes the request when `stopped` turns True.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from specdecode.engine.stats import GenerationStats


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one round adds: new text and the tokens behind it, with where each came from.

    A token comes with the chunk that shows the last of its text: text held back (a possible
    stop string's start, an incomplete character) holds its tokens back too, so the tokens of
    all chunks are exactly the output the text shows, also when a stop string cuts a round."""

    text: str
    tokens: list[int]
    sources: list[str]



class TextAssembler:
    """One sequence's output as text: rounds of tokens in, chunks of text out, stop strings applied.

    A stop string ends the output with the token whose text holds its first character (text
    arrives in whole characters: a token that leaves one incomplete shows its text with the
    token completing it); the tokens after it are dropped and not counted (`stats.cut_output`),
    and `stopped` turns True. A stop never starts in text already shown, so no token already
    handed out is dropped."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], stats: GenerationStats) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop, self.stats = stop, stats
        self.text = ""  # the decoded output so far (complete characters only)
        self.tokens: list[int] = []
        self.sources: list[str] = []
        self.ends: list[int] = []  # ends[i]: len(text) once token i was added
        self.shown = ""
        self.released = 0  # tokens handed out in chunks: those whose text is all shown
        self.stopped = False

    def chunks(self, tokens: list[int], sources: list[str], ended: bool) -> list[Chunk]:
        """What a round's tokens make showable and, once the output has ended (`ended`: EOS, its
        budget or its context; not a stop string, which ends it here), the held-back rest."""
        out = [self.add(tokens, sources)]
        if ended and not self.stopped and (tail := self.finish()) is not None:
            out.append(tail)
        return out

    def add(self, tokens: list[int], sources: list[str]) -> Chunk:
        """The chunk a round's tokens make showable."""
        for tok in tokens:
            self.text += self.detok.add(tok)
            self.ends.append(len(self.text))
        self.tokens += tokens
        self.sources += sources
        text, shown, released = self.text, self.shown, self.released
        cut = _find_stop(text, self.stop, len(shown))
        if cut is not None:
            total = max(released, next(i for i, e in enumerate(self.ends) if e > cut) + 1)  # max: belt and braces
            self.stats.cut_output(total)
            self.stats.finish_reason = "stop"
            self.stopped = True
            self.shown, self.released = text[:cut], total
            return Chunk(text[len(shown):cut], self.tokens[released:total], self.sources[released:total])
        ready = _streamable_length(text, self.stop)
        upto = released
        while upto < len(self.ends) and self.ends[upto] <= ready:
            upto += 1
        self.shown, self.released = text[:ready], upto
        return Chunk(text[len(shown):ready], self.tokens[released:upto], self.sources[released:upto])

    def finish(self) -> Chunk | None:
        """The held-back rest once the sequence has ended without a stop string (None: nothing)."""
        tail = self.detok.finish()[len(self.shown):]
        if not tail and self.released == len(self.tokens):
            return None
        chunk = Chunk(tail, self.tokens[self.released:], self.sources[self.released:])
        self.shown, self.released = self.shown + tail, len(self.tokens)
        return chunk


class IncrementalDetokenizer:
    """Output text token by token, at a cost per token that does not grow with the output.

    `add` returns the text a token completes (complete characters only: a UTF-8 character split
    across tokens appears with the token that completes it); `finish` returns the whole text,
    exactly `tokenizer.decode(tokens, skip_special_tokens=True)` (one full decode, at the end).
    Fast tokenizers step a `tokenizers.decoders.DecodeStream`; others (slow tokenizers, or ones
    that clean up tokenization spaces, which DecodeStream does not) decode a bounded window
    with the prefix-offset technique of vLLM/TGI: the text of tokens[prefix:] minus that of
    tokens[prefix:read], emitted once it no longer ends in an incomplete character.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, use_stream: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = self._read = 0
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        if use_stream is None:
            use_stream = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._stream = None
        if use_stream:
            from tokenizers.decoders import DecodeStream

            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        if self._stream is not None:
            return self._stream.step(self._backend, token) or ""
        prefix_text = self._decode(self.tokens[self._prefix:self._read])
        new_text = self._decode(self.tokens[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.tokens)
            return new_text[len(prefix_text):]
        return ""

    def finish(self) -> str:
        return self._decode(self.tokens)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def _streamable_length(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` is safe to show: hold back an incomplete UTF-8 character and any
    suffix that could be the start of a stop string (it may complete next round)."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        # the longest tail of text (shorter than s) that begins s: its start is an occurrence of s[0], so
        # only those are tested, earliest first (trying every length was quadratic in a long stop string)
        i = text.find(s[0], len(text) - min(len(s) - 1, len(text)), len(text) - hold)
        while i != -1:
            if s.startswith(text[i:]):
                hold = len(text) - i
                break
            i = text.find(s[0], i + 1, len(text) - hold)
    return len(text) - hold


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index where the first stop string begins, looking only at text not yet shown (plus overlap)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
