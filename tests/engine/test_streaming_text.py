"""Streaming text: incremental detokenisation (multi-byte characters split across tokens,
skipped special tokens), stop strings, and the tokens counted when a stop string cuts a round.

A byte-level tokenizer built in-process; the rounds are scripted (no model) and fed to the text
layer as the engine feeds it, so every case is exact and deterministic.
"""

from __future__ import annotations

import functools

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import specdecode.engine.text as text_module
from specdecode.engine.stats import GenerationStats, RoundRecord
from specdecode.engine.text import IncrementalDetokenizer, TextAssembler

TEXT = "héllo 👋 wörld, stop→here END 🎉! ça va? 日本語 ok"
SPECIAL = "<eos>"


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel decoder inverts)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = byte_to_unicode()


def segments() -> list[bytes | None]:
    """TEXT's UTF-8 bytes cut into tokens of 1-3 bytes that often split a character; None is a
    special token (skipped in the text). Lengths cycle 1, 2, 3, so cuts fall everywhere."""
    data = TEXT.encode()
    out: list[bytes | None] = []
    i, n = 0, 0
    while i < len(data):
        size = 1 + n % 3
        out.append(data[i:i + size])
        i += size
        n += 1
        if n % 7 == 0:
            out.append(None)
    return out


@pytest.fixture(scope="module")
def tokenizer_and_ids():
    segs = segments()
    vocab = {SPECIAL: 0}
    for seg in segs:
        if seg is not None:
            vocab.setdefault("".join(B2U[b] for b in seg), len(vocab))
    for b in range(256):  # the byte alphabet too, so the vocabulary is a usual byte-level one
        vocab.setdefault(B2U[b], len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL)
    fast.add_special_tokens({"eos_token": SPECIAL})
    ids = [0 if seg is None else vocab["".join(B2U[b] for b in seg)] for seg in segs]
    assert fast.decode(ids, skip_special_tokens=True) == TEXT
    return fast, ids, segs


def stream(tokenizer, ids: list[int], sizes: list[int], stops: tuple[str, ...]):
    """The chunks of an output of rounds that are `ids` cut into the given sizes (cycled), as the engine
    makes them (`TextAssembler.chunks` after each round, until a stop string or the last round)."""
    stats = GenerationStats()
    text = TextAssembler(tokenizer, stops, stats)
    chunks, i, r = [], 0, 0
    while i < len(ids) and not text.stopped:
        round_ = ids[i:i + sizes[r % len(sizes)]]
        stats.add_round(RoundRecord("scripted", 0, 0, len(round_), 0.0, 0.0))
        i, r = i + len(round_), r + 1
        chunks += text.chunks(round_, ["target"] * len(round_), ended=i >= len(ids))
    return chunks, stats


def expected_count(segs: list[bytes | None], cut: int) -> int:
    """Tokens up to the one whose text holds character `cut` (where the stop string begins).

    Text is known token by token only where the bytes so far decode completely: a token that
    leaves a character incomplete shows its text with the token that completes it, so the token
    counted is the one completing the text that holds character `cut`."""
    data = b""
    for i, seg in enumerate(segs):
        data += seg or b""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # ends inside a character
        if len(text) > cut:
            return i + 1
    raise AssertionError("cut past the end")


STOPS = [(), ("wö",), ("👋",), ("→here",), ("END", "ok"), ("日本",), ("ok",), ("!",), ("absent",), ("llo",)]


@pytest.mark.parametrize("use_stream", [None, True, False], ids=["auto", "decodestream", "window"])
@pytest.mark.parametrize("sizes", [[1], [3], [2, 5, 1, 4], [100]], ids=str)
@pytest.mark.parametrize("stops", STOPS, ids=str)
def test_streamed_text_and_token_count(tokenizer_and_ids, use_stream, sizes, stops, monkeypatch):
    tokenizer, ids, segs = tokenizer_and_ids
    if use_stream is not None:  # force DecodeStream, or the window path slow tokenizers take
        monkeypatch.setattr(text_module, "IncrementalDetokenizer",
                            functools.partial(IncrementalDetokenizer, use_stream=use_stream))
    chunks, stats = stream(tokenizer, ids, sizes, stops)
    cuts = [TEXT.find(s) for s in stops if s in TEXT]
    if cuts:
        cut = min(cuts)
        expected_text, n = TEXT[:cut], expected_count(segs, cut)
        assert stats.finish_reason == "stop"
    else:
        expected_text, n = TEXT, len(ids)
    assert "".join(c.text for c in chunks) == expected_text
    assert all("\ufffd" not in c.text for c in chunks)  # never a half character on screen
    tokens = [t for c in chunks for t in c.tokens]
    assert tokens == ids[:n]  # the usage count: up to the token holding the stop's first character
    assert stats.new_tokens == n
    assert all(len(c.tokens) == len(c.sources) for c in chunks)


@pytest.mark.parametrize("use_stream", [True, False], ids=["decodestream", "window"])
def test_detokenizer_matches_decode_and_is_incremental(tokenizer_and_ids, use_stream):
    """Concatenated deltas are a prefix of decode(all) at every step, and all of it whenever no
    character is incomplete,
    and no call decodes more than a few tokens (no per-round re-decode of the whole output)."""
    tokenizer, ids, _ = tokenizer_and_ids
    ids = ids * 5
    lengths: list[int] = []
    original = tokenizer.decode

    def spy(tokens, *args, **kwargs):
        lengths.append(len(tokens))
        return original(tokens, *args, **kwargs)

    tokenizer.decode = spy
    try:
        detok = IncrementalDetokenizer(tokenizer, use_stream)
        text = ""
        for i, tok in enumerate(ids):
            text += detok.add(tok)
            full = original(ids[: i + 1], skip_special_tokens=True)
            assert full.startswith(text)
            if not full.endswith("\ufffd"):  # no incomplete character pending: all text is out
                assert text == full
        decode_calls = list(lengths)
        assert detok.finish() == original(ids, skip_special_tokens=True) == TEXT * 5
    finally:
        del tokenizer.decode
    assert max(decode_calls, default=0) <= 8  # bounded windows only (the final `finish` aside)


def test_stream_quadratic_redecode_is_gone(tokenizer_and_ids):
    """Through the text layer: only the final text is decoded whole, once (was: every round)."""
    tokenizer, ids, _ = tokenizer_and_ids
    lengths: list[int] = []
    original = tokenizer.decode
    tokenizer.decode = lambda tokens, *a, **k: (lengths.append(len(tokens)), original(tokens, *a, **k))[1]
    try:
        chunks, _ = stream(tokenizer, ids * 4, [3], ())
    finally:
        del tokenizer.decode
    assert "".join(c.text for c in chunks) == TEXT * 4
    assert sum(n > 8 for n in lengths) <= 1
