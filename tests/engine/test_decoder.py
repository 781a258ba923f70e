"""The text API: seeds, streaming, stop strings, chat template, and clear errors on bad input."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdecode.backends.hf import HFModel
from specdecode.backends.weights import load_model
from specdecode.core.probs import GREEDY, SamplingParams
from specdecode.drafters.model import ModelDrafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.loading import check_compatible
from specdecode.engine.text import _streamable_length
from tests.tiny import CHARS, SPECIALS, char_tokenizer, tiny_model, tiny_pair

VOCAB = len(SPECIALS) + len(CHARS)


@pytest.fixture(scope="module")
def decoder():
    target, draft = tiny_pair(vocab=VOCAB, seed=2, noise=0.1, scale=0.3)
    return SpeculativeDecoder(target, char_tokenizer(), [ModelDrafter(draft)], eos_ids=[0])


SAMPLED = GenerationConfig(max_new_tokens=30, sampling=SamplingParams(temperature=0.9, top_p=0.95), k=3, seed=5)


def test_same_seed_same_output(decoder):
    a = decoder.generate("def f(x):", SAMPLED)
    b = decoder.generate("def f(x):", SAMPLED)
    c = decoder.generate("def f(x):", GenerationConfig(**{**_fields(SAMPLED), "seed": 6}))
    assert a.tokens == b.tokens and a.text == b.text
    assert a.tokens != c.tokens


def test_same_seed_same_output_with_adaptive_k(decoder):
    """Adaptive K keeps its timings fixed after calibration and its acceptance state per request,
    so K per round, and therefore the sample a seed yields, repeats across requests."""
    config = GenerationConfig(**{**_fields(SAMPLED), "k": None})
    runs = [decoder.generate("def f(x):", config).tokens for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def _fields(config):
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


def test_stream_concatenates_to_generate(decoder):
    chunks = list(decoder.stream("hello", SAMPLED))
    gen = decoder.generate("hello", SAMPLED)
    assert "".join(c.text for c in chunks) == gen.text
    assert [t for c in chunks for t in c.tokens] == gen.tokens
    assert all(len(c.tokens) == len(c.sources) for c in chunks)
    # the last token is a plain target step when only one token of budget is left
    assert {s for c in chunks for s in c.sources} <= {"draft", "correction", "bonus", "target"}


def test_greedy_text_equals_plain(decoder):
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=4)
    spec = decoder.generate("x = ", config)
    plain = decoder.generate("x = ", config, speculative=False)
    assert spec.text == plain.text and len(spec.tokens) == 40
    assert {s for c in plain.chunks for s in c.sources} == {"target"}
    assert spec.stats.num_rounds < plain.stats.num_rounds  # fewer target passes
    assert spec.finish_reason == "length"


def test_the_prompt_and_the_first_token_take_one_pass(decoder, monkeypatch):
    """The prompt's rest (all but its last token, `pending`) runs in the row that yields the first
    token: n plain tokens take n target passes, not a prompt pass and n steps. The tokens are the
    old order's (the control: the prompt's own pass, then one-token steps, by hand); the pass's
    share of the prompt counts as prefill, not as a verified token."""
    from specdecode.engine import round

    passes = []
    real = round.forward_batch
    monkeypatch.setattr(round, "forward_batch", lambda rows: passes.append([len(r.tokens) for r in rows]) or real(rows))
    prompt, n = "def f(x):", 6
    ids = decoder.encode(prompt)
    out = decoder.generate(prompt, GenerationConfig(max_new_tokens=n, sampling=GREEDY), speculative=False)
    assert len(ids) > 3 and passes == [[len(ids)]] + [[1]] * (n - 1)
    assert out.stats.rounds[0].verified == 1 and out.stats.t_prefill > 0
    target = decoder.target
    target.truncate(0)
    target.forward(ids[:-1], n_logits=1)
    by_hand, last = [], ids[-1]
    for _ in range(n):
        last = int(target.forward([last], n_logits=1)[0].argmax())
        by_hand.append(last)
    assert out.tokens == by_hand


def test_stop_string_truncates_text(decoder):
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=4)
    full = decoder.generate("x = ", config).text
    stop = full[10:12]
    first = full.find(stop)
    gen = decoder.generate("x = ", GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=4, stop=(stop,)))
    assert gen.text == full[:first]
    assert "".join(c.text for c in decoder.stream("x = ", GenerationConfig(
        max_new_tokens=40, sampling=GREEDY, k=4, stop=(stop,)))) == full[:first]  # nothing streamed past it
    assert gen.finish_reason == "stop"


@pytest.mark.parametrize("same_prompt", [False, True])
def test_interleaved_streams_of_one_decoder_are_each_what_they_are_alone(decoder, same_prompt):
    """Two stream() generators of one decoder advanced in turn are two requests of its one engine
    (one slot here: the second waits while its steps run the first to its end, whose chunks wait for
    their reader). Each yields exactly what it yields alone. (With two drivers on one cache this had
    to raise: the older stream's cache was the newer one's.) same_prompt: equal prompt lengths."""
    config_a = GenerationConfig(**{**_fields(SAMPLED), "seed": 1})
    config_b = GenerationConfig(**{**_fields(SAMPLED), "seed": 2})
    prompt_b = "hello" if same_prompt else "a longer prompt"
    a = decoder.stream("hello", config_a)
    b = decoder.stream(prompt_b, config_b)
    first_a = next(a)
    first_b = next(b)
    rest_a = list(a)
    rest_b = list(b)
    assert rest_a, "the first stream had ended before the second began: nothing interleaved"
    for first, rest, prompt, config in ((first_a, rest_a, "hello", config_a), (first_b, rest_b, prompt_b, config_b)):
        expected = decoder.generate(prompt, config)
        assert first.text + "".join(c.text for c in rest) == expected.text
        assert first.tokens + [t for c in rest for t in c.tokens] == expected.tokens
    assert not decoder.scheduler.running and len(decoder.scheduler.free) == decoder.max_batch


@pytest.mark.parametrize("start", [3, 10, 17])
def test_stop_string_counts_only_tokens_up_to_it(decoder, start):
    """A stop string inside a round: tokens and usage (stats.new_tokens) end with the token that
    holds the stop's first character (one character per token here), not with the round."""
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=4)
    full = decoder.generate("x = ", config)
    stop = full.text[start:start + 2]
    first = full.text.find(stop)
    gen = decoder.generate("x = ", GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=4, stop=(stop,)))
    assert gen.text == full.text[:first]
    assert gen.tokens == full.tokens[: first + 1]
    assert gen.stats.new_tokens == first + 1 == sum(r.emitted for r in gen.stats.rounds)
    assert gen.stats.accepted <= first + 1


def test_chat_template_is_applied(decoder):
    ids = decoder.encode([{"role": "user", "content": "hi"}])
    assert decoder.tokenizer.decode(ids) == "[user]hi\n[assistant]"
    assert decoder.encode("hi", chat=True) == ids
    assert decoder.encode("hi") == decoder.tokenizer.encode("hi")


@pytest.mark.parametrize("call, match", [
    (lambda d: d.generate("", SAMPLED), "prompt is empty"),
    (lambda d: d.generate([], SAMPLED), "empty list of messages"),
    (lambda d: d.generate("a" * 300, SAMPLED), "context"),
    (lambda d: GenerationConfig(k=0), "k must be an integer >= 1"),
    (lambda d: SpeculativeDecoder.load(drafter="medusa"), "drafter must be one of"),
    (lambda d: GenerationConfig(max_new_tokens=0), "max_new_tokens"),
    (lambda d: SamplingParams(temperature=-1), "temperature"),
    (lambda d: SamplingParams(top_p=1.5), "top_p"),
    (lambda d: SamplingParams(top_k=-2), "top_k"),
])
def test_bad_input(decoder, call, match):
    with pytest.raises(ValueError, match=match):
        call(decoder)


@pytest.mark.parametrize("call, error, match", [
    # each once failed deep inside with a message about something else, or not at all
    (lambda d: d.generate("hi", {"max_new_tokens": 3}), TypeError, "config must be a GenerationConfig"),
    (lambda d: d.generate("hi", SAMPLED, speculative="no"), TypeError, "speculative must be True or False"),
    (lambda d: d.generate("hi", SAMPLED, chat="yes"), TypeError, "chat must be True, False or None"),
    (lambda d: d.generate(b"hi", SAMPLED), TypeError, "stream_ids"),
    (lambda d: d.generate(123, SAMPLED), TypeError, "text .str. or a list of chat messages"),
    (lambda d: d.generate([{}], SAMPLED), TypeError, "message 0 must be a dict with a string 'role'"),
    (lambda d: d.generate([{"role": "user", "content": 5}], SAMPLED), TypeError, "message 0"),
    (lambda d: d.generate("a\udcffb", SAMPLED), ValueError, "not valid UTF-8"),
    (lambda d: d.generate([{"role": "user", "content": "\ud800"}], SAMPLED), ValueError, "message 0's content"),
    (lambda d: d.generate_many(["a", "b"], [{}, {}]), TypeError, "config must be a GenerationConfig"),
    (lambda d: GenerationConfig(sampling={"temperature": 1}), TypeError, "sampling must be a SamplingParams"),
    (lambda d: GenerationConfig(stop=5), TypeError, "stop must be a string or a list of strings"),
    (lambda d: SamplingParams(temperature=True), ValueError, "temperature"),
    # token ids: out of range failed in torch's embedding (IndexError) or llama_decode; text with "too many
    # dimensions"; floats and bools were taken
    (lambda d: d.generate_ids([5, d.target.vocab_size], SAMPLED), ValueError, "token id .* index 1 .*vocabulary"),
    (lambda d: d.generate_ids([-1], SAMPLED), ValueError, "token id -1 at index 0"),
    (lambda d: d.generate_ids("abc", SAMPLED), TypeError, "token ids must be a list of ints"),
    (lambda d: list(d.stream_ids([1.5], SAMPLED)), TypeError, "token ids must be ints, got 1.5"),
    (lambda d: d.generate_ids([True, False], SAMPLED), TypeError, "token ids must be ints, got True"),
    (lambda d: list(d.stream("ab", SAMPLED, stats={})), TypeError, "stats must be a GenerationStats"),
    (lambda d: list(d.stream_many(["ab", "cd"], SAMPLED, stats=[1, 2])), TypeError, "stats must be a GenerationStats"),
    (lambda d: d.generate_many(["ab"], None), TypeError, "configs must be a GenerationConfig or one per prompt"),
    (lambda d: d.generate_many(b"ab", SAMPLED), ValueError, "take a list of prompts"),
    (lambda d: GenerationConfig(verification=["token"]), ValueError, "verification must be one of"),
])
def test_wrong_types_are_named(decoder, call, error, match):
    with pytest.raises(error, match=match):
        call(decoder)


def test_a_prompt_that_does_not_fit_names_the_setting_that_would_fit_it(decoder):
    """A prompt that does not fit said only "shorten the prompt"; where the backend's context is a
    setting (llama.cpp's n_ctx), the error now names it too: the library's parameter, which the CLI names
    as its option."""
    from specdecode.cli.flags import cli_message

    with pytest.raises(ValueError, match="must fit\\): shorten the prompt$"):  # a model's own limit: nothing to raise
        decoder.generate("a" * 300, SAMPLED)
    decoder.target.context_setting = "n_ctx"
    try:
        with pytest.raises(ValueError, match="shorten the prompt or raise n_ctx$") as raised:
            decoder.generate("a" * 300, SAMPLED)
        assert cli_message(raised.value).endswith("shorten the prompt or raise --n-ctx")
    finally:
        del decoder.target.context_setting


def test_numpy_numbers_are_numbers(decoder):
    """A budget or a temperature computed with numpy (np.int64, np.float32) was refused as "not an
    integer"; it is taken, and stored as a Python number. numpy's bool is still refused."""
    config = GenerationConfig(max_new_tokens=np.int64(5), k=np.int32(2), seed=np.uint64(7),
                              sampling=SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3)))
    assert (config.max_new_tokens, config.k, config.seed) == (5, 2, 7)
    assert type(config.max_new_tokens) is int and type(config.sampling.temperature) is float
    assert config.sampling.top_k == 3 and type(config.sampling.top_k) is int
    assert len(decoder.generate_ids([1, 2, 3], config)) == 5
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=np.bool_(True))


def test_one_stop_string_is_one_stop_not_its_characters(decoder):
    """stop="ab" once stopped at the first "a" (the string was iterated); None was a TypeError."""
    assert GenerationConfig(stop="ab").stop == ("ab",) and GenerationConfig(stop=None).stop == ()
    assert GenerationConfig(stop=["ab", "c"]).stop == ("ab", "c")
    config = GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=4)
    full = decoder.generate("x = ", config).text
    # a pair first seen at i whose characters both occur before i: cut at its characters, the text ends sooner
    i = next(i for i in range(1, len(full) - 2)
             if full.find(full[i:i + 2]) == i and full[i] in full[:i] and full[i + 1] in full[:i])
    cut = decoder.generate("x = ", GenerationConfig(max_new_tokens=40, sampling=GREEDY, k=4, stop=full[i:i + 2])).text
    assert cut == full[:i]


def test_incompatible_vocabularies():
    tok = char_tokenizer()
    a = HFModel(tiny_model(VOCAB, seed=1), "a")
    b = HFModel(tiny_model(VOCAB + 3, seed=2), "b")
    with pytest.raises(ValueError, match="different vocabularies"):
        check_compatible(a, tok, b, tok)
    other = char_tokenizer()
    other.add_tokens(["<extra>"])  # same logits width, different token -> id map
    with pytest.raises(ValueError, match="different tokenizers"):
        check_compatible(a, tok, HFModel(tiny_model(VOCAB, seed=3), "c"), other)


def test_missing_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/nonexistent/model", "target", torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/nonexistent/model.gguf", "draft", torch.float32, "cpu")


def test_saved_directory_round_trip(tmp_path):
    """A user's transformers directory loads through the same path as the embedded pair."""
    model = tiny_model(VOCAB, seed=4, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    loaded, tok = load_model(tmp_path, "target", torch.float32, "cpu")
    assert loaded.vocab_size == VOCAB and tok.encode("ab") == char_tokenizer().encode("ab")


@pytest.mark.parametrize("speculative", [True, False])
def test_decode_rate_counts_the_rounds_own_work_not_only_drafting_and_the_pass(decoder, monkeypatch, speculative):
    """tokens_per_second left out turning logits into tokens (t_draft + t_verify time only drafting and
    the pass), so a full sort for top-p, 12 ms a token, never showed in it. Made slow here by 20 ms a
    call, that work must show in t_decode and not in t_draft + t_verify."""
    import time as clock
    from specdecode.engine import round, verification  # the verify stage, and a plain step's token
    real = round.logits_to_probs

    def slow(*a, **kw):
        clock.sleep(0.02)
        return real(*a, **kw)
    for module in (round, verification):
        monkeypatch.setattr(module, "logits_to_probs", slow)
    stats = decoder.generate("x = ", SAMPLED, speculative=speculative).stats
    assert stats.t_decode >= stats.t_draft + stats.t_verify + 0.02 * stats.num_rounds
    assert stats.tokens_per_second == pytest.approx(stats.new_tokens / stats.t_decode)
    assert all(r.t_round >= r.t_draft + r.t_verify for r in stats.rounds)


@settings(max_examples=1000, deadline=None)
@given(st.text(alphabet="ab\ufffd", max_size=14), st.lists(st.text(alphabet="ab", min_size=1, max_size=7), max_size=3))
def test_the_stop_hold_back_is_the_longest_tail_that_begins_a_stop(text, stops):
    """What streaming holds back (text that may yet become a stop string, or a split character) equals
    the definition, tried length by length (the old code, quadratic in a stop string's length)."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        hold = max([hold] + [n for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])])
    assert _streamable_length(text, tuple(stops)) == len(text) - hold
