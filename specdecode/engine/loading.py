"""Loading a target, its drafters and its tokenizer by name: SpeculativeDecoder.load's work.

Every option is checked against the others before anything loads (the embedded pair takes a
minute): an option that the chosen backend or drafter would not read is refused, naming what reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from specdecode.backends.hf import resolve_device, resolve_dtype
from specdecode.backends.protocol import Model
from specdecode.checks import SettingError, integer
from specdecode.drafters import auto_drafters
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.protocol import Drafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine.config import DRAFTER_CHOICES


@dataclass(frozen=True, slots=True)
class Loaded:
    target: Model
    tokenizer: PreTrainedTokenizerBase
    drafters: list[Drafter]
    max_batch: int


def load(target: str | None = None, draft: str | None = None, *, drafter: str = "auto", backend: str = "auto",
         dtype: str = "auto", device: str = "auto", draft_int8: bool | None = None, draft_vocab: int | None = None,
         draft_confidence: float = 0.0, speculative: bool = True, threads: int = 0, n_ctx: int = 0,
         max_batch: int = 1, tree: int = 0, progress: bool = True) -> Loaded:
    """The models and drafters `SpeculativeDecoder.load` describes (its docstring has the options)."""
    from specdecode.backends.llamacpp import LlamaSettings
    from specdecode.backends.native import NativeSettings
    from specdecode.backends.weights import GGUF_BACKENDS, load_model, resolve_backend  # heavy: only when loading

    if drafter not in DRAFTER_CHOICES:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTER_CHOICES)}, got {drafter!r}")
    device = resolve_device(device)
    backend = resolve_backend(backend, target, device)
    _check_backend_options(backend, dtype, draft_int8, draft_vocab, threads, n_ctx)
    torch_dtype = resolve_dtype(dtype, device)
    if integer(max_batch) is None or max_batch < 0:
        raise ValueError(f"max_batch must be an integer >= 1 (0 = auto), got {max_batch!r}")
    max_batch = max_batch or (DEFAULT_MAX_BATCH if backend in GGUF_BACKENDS else 1)
    _check_drafter_options(drafter, draft, draft_int8, draft_vocab, draft_confidence, tree)
    if draft is not None and not speculative:
        raise SettingError("{draft} is a draft model, which plain decoding ({speculative=False}) does not load: "
                           "drop one of them")
    settings = LlamaSettings(n_ctx=n_ctx, n_threads=threads, n_seq_max=max_batch,
                             tree_leaves=tree + 1 if tree else 0)
    target_model, tokenizer = load_model(target, "target", torch_dtype, device, progress=progress,
                                         backend=backend, llama_settings=settings,
                                         native_settings=NativeSettings(n_ctx=n_ctx, n_threads=threads))
    drafters: list[Drafter] = []
    if speculative and drafter == "lookup":
        drafters.append(LookupDrafter())
    if speculative and drafter == "suffix":
        drafters.append(SuffixDrafter(tree=tree))
    if speculative and drafter in LOADS_DRAFT:
        draft_backend = resolve_backend(backend, draft, device)
        # a native draft computes logits for the most frequent tokens only (q = 0 elsewhere: exact anyway)
        draft_native = NativeSettings(n_ctx=n_ctx, n_threads=threads, head_tokens=DEFAULT_DRAFT_VOCAB)
        draft_model, draft_tokenizer = load_model(draft, "draft", torch_dtype, device, progress=progress,
                                                  backend=draft_backend, llama_settings=settings,
                                                  native_settings=draft_native)
        check_compatible(target_model, tokenizer, draft_model, draft_tokenizer)
        if draft_backend == "transformers":
            make_cheaper(draft_model, tokenizer, device, draft_int8, draft_vocab)
        drafters += auto_drafters(draft_model, tree, draft_confidence) if drafter == "auto" else \
            [ModelDrafter(draft_model, min_confidence=draft_confidence, tree=tree)]
    return Loaded(target_model, tokenizer, drafters, max_batch)


LOADS_DRAFT = ("auto", "model")  # the drafters that run a draft model


def _check_backend_options(backend: str, dtype: str, draft_int8: bool | None, draft_vocab: int | None,
                           threads: int, n_ctx: int) -> None:
    from specdecode.backends.weights import GGUF_BACKENDS

    if backend in GGUF_BACKENDS:
        if dtype != "auto":
            raise SettingError(f"{{dtype={dtype}}} applies to the transformers backend; {backend} runs the "
                               f"GGUF's own weights (add {{backend=transformers}} to choose a dtype)")
        if draft_int8 is not None or draft_vocab is not None:  # draft_int8=False too: it reads nothing
            raise SettingError(f"{{draft_int8}}/{{draft_vocab}} apply to a transformers draft; on {backend} the "
                               f"draft runs its GGUF as it is (add {{backend=transformers}})")
    elif threads or n_ctx:
        raise SettingError("{threads}/{n_ctx} apply to the GGUF backends (native, llama.cpp): drop them, or give "
                           "{backend=native} with GGUF models")


def _check_drafter_options(drafter: str, draft: str | None, draft_int8: bool | None, draft_vocab: int | None,
                           draft_confidence: float, tree: int) -> None:
    if integer(tree) is None or not 0 <= tree <= MAX_TREE:
        raise ValueError(f"tree must be an integer in 0..{MAX_TREE} (extra draft-tree nodes per round), got {tree!r}")
    if drafter in LOADS_DRAFT:
        return
    if draft is not None:
        raise SettingError(f"{{draft}} is a draft model, which {{drafter={drafter}}} does not use (it loads "
                           f"none): drop {{draft}}, or use {{drafter=auto}} or model")
    if draft_int8 is not None or draft_vocab is not None:
        raise SettingError(f"{{draft_int8}}/{{draft_vocab}} shape a draft model, which {{drafter={drafter}}} "
                           f"does not use: drop them, or use {{drafter=auto}} or model")
    if draft_confidence:
        raise SettingError(f"{{draft_confidence}} ends a draft model's drafts, which {{drafter={drafter}}} "
                           f"does not use: drop it, or use {{drafter=auto}} or model")
    if tree and drafter != "suffix":
        raise SettingError(f"{{tree}} needs a drafter with alternatives to offer: {{drafter=model}}, auto or "
                           f"suffix (prompt lookup copies one continuation), not {drafter}")


def make_cheaper(draft: Model, tokenizer: PreTrainedTokenizerBase, device: str, int8: bool | None,
                 vocab: int | None) -> None:
    """Apply the cheap-draft transforms in place (None: the defaults for the device)."""
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


# sequences a GGUF backend decodes at once by default: both run them in one pass, where 4 one-token
# rows cost well under 4 steps
DEFAULT_MAX_BATCH = 4
MAX_TREE = 16  # extra tree nodes a round may verify (each is a token of the pass)

# a transformers draft on a CPU: its head cut to the frequent tokens and its weights in int8 make it
# several times cheaper, its acceptance unchanged (backends/cheap.py)
DEFAULT_DRAFT_VOCAB = 32768
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


def eos_ids(tokenizer: PreTrainedTokenizerBase, target: Model) -> set[int]:
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
