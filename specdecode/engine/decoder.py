"""Text in, text out: tokenizer, chat template, stop strings and streaming around the loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from transformers import PreTrainedTokenizerBase

from specdecode.backends.hf import resolve_device, resolve_dtype
from specdecode.backends.protocol import Model
from specdecode.core.probs import SamplingParams
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.protocol import Drafter
from specdecode.engine.config import GenerationConfig
from specdecode.engine.loop import generate_tokens
from specdecode.engine.stats import GenerationStats

Prompt = str | Sequence[dict]  # plain text, or chat messages [{"role": ..., "content": ...}]


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one round adds: new text and the tokens behind it, with where each came from."""

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
    """A target model, an optional drafter and a tokenizer: generate text speculatively.

    Build it once (loading models is the slow part) and call `generate`/`stream` per request.
    """

    def __init__(self, target: Model, tokenizer: PreTrainedTokenizerBase, drafter: Drafter | None = None,
                 eos_ids: Sequence[int] | None = None) -> None:
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        if eos_ids is None:
            eos_ids = _eos_ids(tokenizer, getattr(target, "model", None))
        self.eos_ids = frozenset(eos_ids)

    @classmethod
    def load(cls, target: str | None = None, draft: str | None = None, *, dtype: str = "auto",
             device: str = "auto", speculative: bool = True, progress: bool = True) -> "SpeculativeDecoder":
        """Load target and draft: None = the embedded pair; else a model directory or a .gguf file."""
        from specdecode.backends.weights import load_model  # heavy imports only when loading

        device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, device)
        target_model, tokenizer = load_model(target, "target", torch_dtype, device, progress=progress)
        drafter = None
        if speculative:
            draft_model, draft_tokenizer = load_model(draft, "draft", torch_dtype, device, progress=progress)
            check_compatible(target_model, tokenizer, draft_model, draft_tokenizer)
            drafter = ModelDrafter(draft_model)
        return cls(target_model, tokenizer, drafter)

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt. Messages always use the chat template; text does when chat=True."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if not chat:
                return list(self.tokenizer.encode(prompt))
            prompt = [{"role": "user", "content": prompt}]
        if not prompt:
            raise ValueError("the prompt is an empty list of messages")
        if self.tokenizer.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass plain text without --chat")
        ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def stream(self, prompt: Prompt, config: GenerationConfig = GenerationConfig(), *, chat: bool | None = None,
               speculative: bool = True, stats: GenerationStats | None = None) -> Iterator[Chunk]:
        """Yield text as rounds are emitted. `stats` (optional) is filled in as it goes."""
        ids = self.encode(prompt, chat)
        stats = stats if stats is not None else GenerationStats()
        drafter = self.drafter if speculative else None
        rounds = generate_tokens(self.target, drafter, ids, config, self.eos_ids, stats)
        out: list[int] = []
        shown = ""
        for rnd in rounds:
            out += rnd.tokens
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            cut = _find_stop(text, config.stop, len(shown))
            if cut is not None:
                yield Chunk(text[len(shown):cut], rnd.tokens, rnd.sources)
                stats.finish_reason = "stop"
                rounds.close()
                return
            ready = _streamable_length(text, config.stop)
            yield Chunk(text[len(shown):ready], rnd.tokens, rnd.sources)
            shown = text[:ready]
        tail = self.tokenizer.decode(out, skip_special_tokens=True)[len(shown):]
        if tail:
            yield Chunk(tail, [], [])

    def generate(self, prompt: Prompt, config: GenerationConfig = GenerationConfig(), *,
                 chat: bool | None = None, speculative: bool = True) -> Generation:
        stats = GenerationStats()
        chunks = list(self.stream(prompt, config, chat=chat, speculative=speculative, stats=stats))
        tokens = [t for c in chunks for t in c.tokens]
        return Generation("".join(c.text for c in chunks), tokens, stats, chunks)


def generate(prompt: Prompt, target: str | None = None, draft: str | None = None, *, k: int = 4,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int = 128,
             seed: int = 0, stop: Sequence[str] = (), chat: bool | None = None, speculative: bool = True,
             dtype: str = "auto", device: str = "auto") -> Generation:
    """One call: load the pair (None = embedded) and generate. For many calls, build a SpeculativeDecoder."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, k=k, seed=seed, stop=tuple(stop),
                              sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    decoder = SpeculativeDecoder.load(target, draft, dtype=dtype, device=device, speculative=speculative)
    return decoder.generate(prompt, config, chat=chat, speculative=speculative)


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


def _eos_ids(tokenizer: PreTrainedTokenizerBase, model) -> set[int]:
    """End tokens: the tokenizer's EOS, the generation_config EOS, and known end markers."""
    ids: set[int] = set()
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                   if t.special}
    for marker in END_MARKERS:
        if marker in special:
            ids.add(int(tokenizer.convert_tokens_to_ids(marker)))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    return ids


def _streamable_length(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` is safe to show: hold back an incomplete UTF-8 character and any
    suffix that could be the start of a stop string (it may complete next round)."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return len(text) - hold


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index where the first stop string begins, looking only at text not yet shown (plus overlap)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best is None or i < best):
            best = i
    return best
