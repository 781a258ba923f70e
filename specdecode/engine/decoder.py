"""Text in, text out: tokenizer, chat template, stop strings and streaming around the loop."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from transformers import PreTrainedTokenizerBase

from specdecode.backends.hf import resolve_device, resolve_dtype
from specdecode.backends.protocol import Model
from specdecode.checks import SettingError, check_utf8, integer
from specdecode.core.probs import SamplingParams
from specdecode.drafters import auto_drafters
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.protocol import Drafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine.calibration import CalibrationStore, calibration_key
from specdecode.engine.config import DRAFTER_CHOICES, GenerationConfig
from specdecode.engine.loop import calibrate, new_sequence, run
from specdecode.engine.policy import AdaptiveK
from specdecode.engine.sequence import Sequence as Seq, Slot
from specdecode.engine.stats import GenerationStats


Prompt = str | Sequence[dict]  # plain text, or chat messages [{"role": ..., "content": ...}]


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one round adds: new text and the tokens behind it, with where each came from.

    A token comes with the chunk that shows the last of its text: text held back (a possible
    stop string's start, an incomplete character) holds its tokens back too, so the tokens of
    all chunks are exactly the output the text shows, also when a stop string cuts a round."""

    text: str
    tokens: list[int]
    sources: list[str]


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: GenerationStats
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


class SpeculativeDecoder:
    """A target model, drafters tried in order, and a tokenizer: generate text speculatively.

    Build it once (loading models is the slow part) and call `generate`/`stream` per request,
    one generation at a time, or `generate_many`/`stream_many` for several prompts decoded as
    one batch (up to `max_batch` at once: each a slot, a sequence of the target with its own
    cache and drafters, all verified in one pass per round). With GenerationConfig(k=None) the decoder's AdaptiveK chooses K
    each round from costs measured once per machine (cached, see `calibrate`) and the request's
    own acceptance, so a seed reproduces its sample in any process that uses the same models,
    backend, settings and calibration file; a recalibration or another machine may change K and
    with it the sample (never its law).
    """

    def __init__(self, target: Model, tokenizer: PreTrainedTokenizerBase, drafters: Sequence[Drafter] = (),
                 eos_ids: Sequence[int] | None = None, policy: AdaptiveK | None = None,
                 calibration: CalibrationStore | None = None, recalibrate: bool = False,
                 max_batch: int = 1) -> None:
        if integer(max_batch) is None or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.target, self.tokenizer, self.drafters = target, tokenizer, list(drafters)
        # slot 0 is (target, drafters); the others are their siblings (one cache each)
        self.slots = [Slot(target, tuple(self.drafters))] + [
            Slot(target.sibling(), tuple(d.fork() for d in self.drafters)) for _ in range(max_batch - 1)]
        self.policy = policy if policy is not None else AdaptiveK()
        if max_batch > 1 and not self.policy.batch_sizes:  # a batch's pass holds many rows: measure big passes
            self.policy.batch_sizes = batch_pass_sizes(max_batch, self.policy.k_max)
        # where adaptive K's measured costs are kept across processes (None: measured per process)
        self.calibration, self.recalibrate = calibration, recalibrate
        if eos_ids is None:
            eos_ids = _eos_ids(tokenizer, target)
        self.eos_ids = frozenset(eos_ids)

    @property
    def max_batch(self) -> int:
        return len(self.slots)

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = None, *, drafter: str = "auto",
             backend: str = "auto", dtype: str = "auto", device: str = "auto", draft_int8: bool | None = None,
             draft_vocab: int | None = None, draft_confidence: float = 0.0, speculative: bool = True,
             threads: int = 0, n_ctx: int = 0, recalibrate: bool = False, max_batch: int = 1,
             tree: int = 0, progress: bool = True) -> "SpeculativeDecoder":
        """Load target and draft: None = the embedded pair; else a model directory or a .gguf file.

        backend: "llama.cpp" (GGUF files, CPU), "transformers", or "auto" (llama.cpp for GGUF on
        CPU, else transformers). Both models run on the target's backend: two engines' thread
        pools in one process slow each other down.
        drafter: "model" (draft model), "lookup" (prompt lookup, no draft model), "suffix" (the latest
        continuation in the request's text, else in earlier requests' texts, its length set by how often
        the text continued that way; no draft model),
        or "auto" (lookup when it finds a match, else the draft model; with a tree, the draft model's
        tree with lookup's continuations as copies, else lookup: `drafters.auto_drafters`).
        dtype: transformers only (llama.cpp runs the GGUF's own quantised weights).
        draft_int8 / draft_vocab: make a transformers draft cheaper (exactness is unaffected; see
        backends/cheap.py). None = the measured default for the device.
        draft_confidence: stop a draft early when the draft's top probability falls below it
        (0 = off; speed only, the output law is unchanged).
        tree: up to this many extra draft-tree nodes per round (alternative candidates where the draft
        is unsure, or the suffix drafter's other continuations, verified exactly by the multi-candidate
        rule, core/tree.py); adaptive K keeps only those its cost model says pay. 0 = chains. Needs
        drafter model, auto (the draft model's tree, with prompt lookup's continuations of its
        paths as copies) or suffix.
        threads / n_ctx: llama.cpp only (0 = the machine's cores / the model's context; with
        max_batch > 1 the context of each sequence, by default 32768 tokens shared out).
        max_batch: sequences decoded at once by `generate_many`/`stream_many` and the server
        (0 = auto: DEFAULT_MAX_BATCH on llama.cpp, 1 on transformers, whose sequences of a batch
        run one pass each: README, batching).
        recalibrate: measure adaptive K's costs anew instead of reading them from the cache
        directory, where they are kept per machine, model, backend and drafter.
        """
        from specdecode.backends.llamacpp import LlamaSettings
        from specdecode.backends.weights import cache_dir, load_model, resolve_backend  # heavy: only when loading

        if drafter not in DRAFTER_CHOICES:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_CHOICES)}, got {drafter!r}")
        device = resolve_device(device)
        backend = resolve_backend(backend, target, device)
        if backend == "llama.cpp":
            if dtype != "auto":
                raise SettingError(f"{{dtype={dtype}}} applies to the transformers backend; llama.cpp runs the "
                                   f"GGUF's own weights (add {{backend=transformers}} to choose a dtype)")
            if draft_int8 is not None or draft_vocab is not None:  # --no-draft-int8 too: it reads nothing
                raise SettingError("{draft_int8}/{draft_vocab} apply to a transformers draft; on llama.cpp the "
                                   "draft runs its GGUF as it is (add {backend=transformers})")
        elif threads or n_ctx:
            raise SettingError("{threads}/{n_ctx} apply to the llama.cpp backend (GGUF files): drop them, or give "
                               "{backend=llama.cpp} with GGUF models")
        torch_dtype = resolve_dtype(dtype, device)
        if integer(max_batch) is None or max_batch < 0:
            raise ValueError(f"max_batch must be an integer >= 1 (0 = auto), got {max_batch!r}")
        max_batch = max_batch or (DEFAULT_MAX_BATCH if backend == "llama.cpp" else 1)
        if integer(tree) is None or not 0 <= tree <= MAX_TREE:
            raise ValueError(f"tree must be an integer in 0..{MAX_TREE} (extra draft-tree nodes per round), got {tree!r}")
        loads_draft = drafter in ("auto", "model")  # the drafters that run a draft model
        if draft is not None and not loads_draft:
            raise SettingError(f"{{draft}} is a draft model, which {{drafter={drafter}}} does not use (it loads "
                               f"none): drop {{draft}}, or use {{drafter=auto}} or model")
        if (draft_int8 is not None or draft_vocab is not None) and not loads_draft:
            raise SettingError(f"{{draft_int8}}/{{draft_vocab}} shape a draft model, which {{drafter={drafter}}} "
                               f"does not use: drop them, or use {{drafter=auto}} or model")
        if draft_confidence and not loads_draft:
            raise SettingError(f"{{draft_confidence}} ends a draft model's drafts, which {{drafter={drafter}}} "
                               f"does not use: drop it, or use {{drafter=auto}} or model")
        if tree and drafter not in ("auto", "model", "suffix"):
            raise SettingError(f"{{tree}} needs a drafter with alternatives to offer: {{drafter=model}}, auto or "
                               f"suffix (prompt lookup copies one continuation), not {drafter}")
        settings = LlamaSettings(n_ctx=n_ctx, n_threads=threads, n_seq_max=max_batch,
                                 tree_leaves=tree + 1 if tree else 0)
        target_model, tokenizer = load_model(target, "target", torch_dtype, device, progress=progress,
                                             backend=backend, llama_settings=settings)
        drafters: list[Drafter] = []
        if speculative and drafter == "lookup":
            drafters.append(LookupDrafter())
        if speculative and drafter == "suffix":
            drafters.append(SuffixDrafter(tree=tree))
        if speculative and loads_draft:
            draft_backend = resolve_backend(backend, draft, device)
            draft_model, draft_tokenizer = load_model(draft, "draft", torch_dtype, device, progress=progress,
                                                      backend=draft_backend, llama_settings=settings)
            check_compatible(target_model, tokenizer, draft_model, draft_tokenizer)
            if draft_backend == "transformers":
                make_cheaper(draft_model, tokenizer, device, draft_int8, draft_vocab)
            drafters += auto_drafters(draft_model, tree, draft_confidence) if drafter == "auto" else \
                [ModelDrafter(draft_model, min_confidence=draft_confidence, tree=tree)]
        store = CalibrationStore(cache_dir() / "calibration")
        return cls(target_model, tokenizer, drafters, calibration=store, recalibrate=recalibrate,
                   max_batch=max_batch)

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt. Messages always use the chat template; text does when chat=True."""
        _check_prompt(prompt)
        if chat is not None and not isinstance(chat, bool):
            raise TypeError(f"chat must be True, False or None, got {chat!r}")
        if isinstance(prompt, str):
            if not chat:
                return _some_tokens(list(self.tokenizer.encode(prompt)))
            prompt = [{"role": "user", "content": prompt}]
        if self.tokenizer.chat_template is None:
            raise SettingError("this tokenizer has no chat template; pass plain text without {chat}")
        ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return _some_tokens(list(ids))

    def stream(self, prompt: Prompt, config: GenerationConfig = GenerationConfig(), *, chat: bool | None = None,
               speculative: bool = True, stats: GenerationStats | None = None) -> Iterator[Chunk]:
        """Yield text as rounds are emitted. `stats` (optional) is filled in as it goes."""
        return self.stream_ids(self.encode(prompt, chat), config, speculative=speculative, stats=stats)

    def stream_ids(self, ids: Sequence[int], config: GenerationConfig = GenerationConfig(), *,
                   speculative: bool = True, stats: GenerationStats | None = None) -> Iterator[Chunk]:
        """`stream` for a prompt that is already token ids."""
        _check_request(config, speculative, stats)
        stats = stats if stats is not None else GenerationStats()
        rounds = self._rounds(_check_ids(ids, self.target.vocab_size), config, stats, speculative)
        text = TextAssembler(self.tokenizer, config.stop, stats)
        for rnd in rounds:
            yield text.add(rnd)
            if text.stopped:
                rounds.close()
                return
        tail = text.finish()
        if tail is not None:
            yield tail

    def generate_ids(self, ids: Sequence[int], config: GenerationConfig = GenerationConfig(), *,
                     stats: GenerationStats | None = None, speculative: bool = True) -> list[int]:
        """Token ids in, generated token ids out (no text processing, no stop strings)."""
        _check_request(config, speculative, stats)
        stats = stats if stats is not None else GenerationStats()
        ids = _check_ids(ids, self.target.vocab_size)
        return [t for rnd in self._rounds(ids, config, stats, speculative) for t in rnd.tokens]

    def _rounds(self, ids: list[int], config: GenerationConfig, stats: GenerationStats, speculative: bool):
        return run(self.sequence(self.slots[0], ids, config, stats, speculative))

    def sequence(self, slot: Slot, ids: Sequence[int], config: GenerationConfig, stats: GenerationStats,
                 speculative: bool = True) -> Seq:
        """A request's state in `slot` (checked; adaptive K calibrated first if it never was)."""
        if config.k is None and speculative and self.drafters and self.policy.wants_calibration():
            self.calibrate(ids, config.sampling, slot)
        policy = self.policy.for_request() if config.k is None else None  # None: FixedK(config.k)
        return new_sequence(slot, ids, config, self.eos_ids, stats, policy, speculative=speculative)

    def generate_many(self, prompts: Sequence[Prompt], configs: GenerationConfig | Sequence[GenerationConfig]
                      = GenerationConfig(), *, chat: bool | None = None,
                      speculative: bool = True) -> list[Generation]:
        """Generate for several prompts as one batch (each with its own config, or one for all);
        results in the prompts' order. Each output has the law it has alone."""
        from specdecode.engine.scheduler import generations

        ids, configs = self._requests(prompts, configs, chat, speculative)
        return generations(self, ids, configs, speculative)

    def stream_many(self, prompts: Sequence[Prompt], configs: GenerationConfig | Sequence[GenerationConfig]
                    = GenerationConfig(), *, chat: bool | None = None, speculative: bool = True,
                    stats: Sequence[GenerationStats] | None = None) -> Iterator[tuple[int, Chunk]]:
        """Stream several prompts decoded as one batch: (prompt index, chunk) as rounds end;
        each prompt's chunks arrive in order. `stats` (optional): one per prompt, filled in."""
        from specdecode.engine.scheduler import stream_batch

        ids, configs = self._requests(prompts, configs, chat, speculative)
        return stream_batch(self, ids, configs, speculative, stats)

    def _requests(self, prompts, configs, chat, speculative) -> tuple[list[list[int]], list[GenerationConfig]]:
        if isinstance(prompts, (str, dict, bytes, bytearray)) or not isinstance(prompts, Sequence):
            raise ValueError("generate_many/stream_many take a list of prompts (for one prompt use generate/stream)")
        if isinstance(configs, GenerationConfig):
            configs = [configs] * len(prompts)
        if isinstance(configs, (str, bytes, dict)) or not isinstance(configs, Iterable):
            raise TypeError(f"configs must be a GenerationConfig or one per prompt, got {type(configs).__name__}")
        configs = list(configs)
        for config in configs:
            _check_request(config, speculative)
        if len(configs) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(configs)} configs: give one config per prompt "
                             f"or one for all")
        return [self.encode(p, chat) for p in prompts], configs

    def calibrate(self, ids: Sequence[int], params: SamplingParams = SamplingParams(temperature=0.0),
                  slot: Slot | None = None) -> None:
        """Give adaptive K its costs: from the calibration cache if it has them for this machine,
        models and drafters, else measured after `ids` (and saved). Runs before the first
        adaptive request by itself; call it earlier to keep it out of that request's latency."""
        if not self.drafters:
            return
        slot = slot or self.slots[0]  # a free slot: measuring resets its caches
        measure = lambda: calibrate(self.policy, slot.target, slot.drafters, list(ids), params)  # noqa: E731
        if self.calibration is None:
            measure()
        else:
            self.calibration.ensure(self.policy, calibration_key(self.target, self.drafters), measure,
                                    self.recalibrate)
            self.recalibrate = False  # once per decoder

    def generate(self, prompt: Prompt, config: GenerationConfig = GenerationConfig(), *,
                 chat: bool | None = None, speculative: bool = True) -> Generation:
        stats = GenerationStats()
        chunks = list(self.stream(prompt, config, chat=chat, speculative=speculative, stats=stats))
        tokens = [t for c in chunks for t in c.tokens]
        return Generation("".join(c.text for c in chunks), tokens, stats, chunks)


def generate(prompt: Prompt, target: str | None = None, draft: str | None = None, *, k: int | None = None,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 128,
             seed: int = 0, stop: Sequence[str] = (), chat: bool | None = None, speculative: bool = True,
             backend: str = "auto", dtype: str = "auto", device: str = "auto") -> Generation:
    """One call: load the pair (None = embedded) and generate; k=None is adaptive K.
    For many calls, build a SpeculativeDecoder once."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, k=k, seed=seed, stop=stop,
                              sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    decoder = SpeculativeDecoder.load(target, draft, backend=backend, dtype=dtype, device=device,
                                      speculative=speculative)
    return decoder.generate(prompt, config, chat=chat, speculative=speculative)


def batch_pass_sizes(max_batch: int, k_max: int) -> tuple[int, ...]:
    """Pass sizes beyond k_max + 1 whose cost a batch's K policy needs (the curve between them is
    interpolated): every size up to 16 (where CPU kernels change tiling), then sparser."""
    top = max_batch * (k_max + 1)
    return tuple(n for n in (*range(k_max + 2, 17), 20, 24, 32, 48, 64, 96, 128) if n <= max(top, k_max + 2))


def make_cheaper(draft: Model, tokenizer: PreTrainedTokenizerBase, device: str, int8: bool | None,
                 vocab: int | None) -> None:
    """Apply the cheap-draft transforms in place (defaults chosen from measurements; README)."""
    import torch

    from specdecode.backends.cheap import frequent_tokens, quantize_int8, restrict_head

    if vocab is None:
        vocab = DEFAULT_DRAFT_VOCAB if device == "cpu" else 0
    if int8 is None:
        int8 = DEFAULT_DRAFT_INT8 and device == "cpu"
    if vocab and vocab < draft.vocab_size:
        # a tokenizer may hold special ids past the model's logits (added tokens it never emits): not kept
        specials = torch.tensor(sorted(i for i in set(tokenizer.all_special_ids) if i < draft.vocab_size),
                                dtype=torch.long)
        restrict_head(draft.model, frequent_tokens(draft.vocab_size, vocab, specials))
    if int8:
        quantize_int8(draft.model)


# Measured on the 2-core CPU with the embedded pair on llama.cpp (README, batching): 4 one-token
# rows cost ~2.5 steps (1.6x the throughput of one at a time), 8 cost ~5.8 steps.
DEFAULT_MAX_BATCH = 4
MAX_TREE = 16  # extra tree nodes a round may verify (each is a token of the pass)

# Measured on the 2-core CPU with the embedded pair (README, "Cheaper drafts").
DEFAULT_DRAFT_VOCAB = 32768  # c 2.69 -> 6.52 with int8, alpha 0.860 unchanged (bf16)
DEFAULT_DRAFT_INT8 = True


def check_compatible(target: Model, target_tok: PreTrainedTokenizerBase, draft: Model,
                     draft_tok: PreTrainedTokenizerBase) -> None:
    """Target and draft must share one vocabulary: q and p index the same tokens."""
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"target and draft have different vocabularies ({target.vocab_size} vs "
                         f"{draft.vocab_size} logits); choose a draft model from the same family/tokenizer")
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError("target and draft use different tokenizers (token -> id maps differ); "
                         "choose a draft model with the target's tokenizer")


# Special tokens that end a text or a chat turn in common tokenizers. GGUF conversions often
# keep only one EOS id (Qwen's GGUF has <|im_end|> but not <|endoftext|>), so we add these
# whenever the tokenizer defines them as special tokens.
END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>", "</s>")


def _eos_ids(tokenizer: PreTrainedTokenizerBase, target: Model) -> set[int]:
    """End tokens: the tokenizer's EOS, known end markers, and the target's own (`Model.eos_ids`)."""
    ids: set[int] = set()
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                   if t.special}
    for marker in END_MARKERS:
        if marker in special:
            ids.add(int(tokenizer.convert_tokens_to_ids(marker)))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids | target.eos_ids


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

    def add(self, rnd) -> Chunk:
        """The chunk a round of tokens (`loop.Round`) makes showable."""
        for tok in rnd.tokens:
            self.text += self.detok.add(tok)
            self.ends.append(len(self.text))
        self.tokens += rnd.tokens
        self.sources += rnd.sources
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


def _check_request(config, speculative, stats=None) -> None:
    """The arguments every generation takes, of the types it reads (a dict for a config failed later
    with an AttributeError; speculative="no" was truthy)."""
    if not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}: build one with "
                        f"GenerationConfig(max_new_tokens=..., ...)")
    if not isinstance(speculative, bool):
        raise TypeError(f"speculative must be True or False, got {speculative!r}")
    check_stats(stats)


def check_stats(stats) -> None:
    """`stats`, where a caller passes one to be filled in: None or a GenerationStats."""
    if stats is not None and not isinstance(stats, GenerationStats):
        raise TypeError(f"stats must be a GenerationStats (or None), got {type(stats).__name__}")


def _check_ids(ids, vocab_size: int) -> list[int]:
    """A prompt of token ids, as a list of ints in [0, vocab_size): an id out of range failed deep in the
    backend (torch's embedding, or llama_decode), a string or floats with a message about dimensions."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
        raise TypeError(f"token ids must be a list of ints, got {type(ids).__name__}; for text use stream() or "
                        f"generate()")
    ids = list(ids)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"token ids must be ints, got {t!r} ({type(t).__name__}) at index {i}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} at index {i} is outside the model's vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


def _check_prompt(prompt) -> None:
    """A prompt is non-empty text or a non-empty list of messages {"role": str, "content": str}, all of
    it valid Unicode: anything else would fail deep in the tokenizer with a message about its types."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        check_utf8(prompt, "the prompt")
        return
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, (list, tuple)):
        raise TypeError(f"a prompt is text (str) or a list of chat messages, got {type(prompt).__name__}; for "
                        f"token ids use stream_ids() or generate_ids()")
    if not prompt:
        raise ValueError("the prompt is an empty list of messages")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise TypeError(f"message {i} must be a dict with a string 'role' and a string 'content', "
                            f"got {message!r}"[:300])
        check_utf8(message["content"], f"message {i}'s content")


def _some_tokens(ids: list[int]) -> list[int]:
    if not ids:
        raise ValueError("the prompt gives no tokens with this model's tokenizer (it drops every character "
                         "of it): give text the tokenizer keeps")
    return ids
