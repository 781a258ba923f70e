"""A transformers/PyTorch backend for any causal LM transformers can load.

Rollback is `DynamicCache.crop`, which slices every layer's K/V to a shorter
length: no copy, and no special case per model class. A draft tree runs in one
pass with a 4D attention mask (each token sees the cache and its ancestors) and
explicit positions; keeping the accepted path selects its K/V entries in every layer.
"""

from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel,
                          PreTrainedTokenizerBase)
from transformers.utils import logging as hf_logging

from specdecode.backends.protocol import Model, Snapshot
from specdecode.checks import SettingError
from specdecode.core.tree import tree_depths

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """'auto' is bfloat16: measured here, bf16 decodes ~2x faster than fp32 on CPU, and it is the GPU norm."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def resolve_device(device: str) -> str:
    """'auto' (CUDA if available, else cpu), 'cpu', 'cuda' or 'cuda:N' (checked against this machine)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingError(f"device {device!r} asked for, but no CUDA device is available; use {{device=cpu}}")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device {device!r} asked for, but this machine has {count} CUDA device(s) "
                             f"(cuda:0..cuda:{count - 1}); choose one of those")
    return device


class HFModel(Model):
    """One sequence's view of a transformers causal LM, with its own KV cache. Its rows of a batch
    run one pass each (transformers' caches are per sequence): the default `forward_batch`."""

    trees = True  # a 4D attention mask (module docstring)
    snapshots = True  # a copy of the DynamicCache

    def __init__(self, model: PreTrainedModel, name: str = "model") -> None:
        self.model = model.eval()
        self.name = name
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().out_features)  # logits width
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0) or 2 ** 31)
        self.cache = DynamicCache(config=model.config)
        self._tree_base: int | None = None  # cache length before a tree pass not yet resolved
        _refuse_sliding_window(self.cache, model.config, name)

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    @property
    def eos_ids(self) -> frozenset[int]:
        """The end ids of the model's generation_config (GGUF conversions often keep fewer in the tokenizer)."""
        ids = self.model.generation_config.eos_token_id  # None, an id, or a list of them
        return frozenset(int(i) for i in (ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids]))

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def signature(self) -> str:
        """What this model's speed depends on (the calibration cache's key): the bytes of its
        weights (int8 or a restricted head change them), dtype, device and torch's threads."""
        size = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        return f"transformers {self.name} ({size} B) {self.dtype} {self.device} threads={torch.get_num_threads()}"

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], n_logits: int = 1) -> torch.Tensor:
        n = len(tokens)
        if n == 0 or not 1 <= n_logits <= n:
            raise ValueError(f"forward needs >= 1 token and 1 <= n_logits <= {n}, got {n} tokens, n_logits={n_logits}")
        if self.length + n > self.max_length:
            raise ValueError(f"{self.name}: {self.length + n} tokens exceed the context of {self.max_length}")
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=n_logits)
        return out.logits[0, -n_logits:]

    @torch.inference_mode()
    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Run a tree after the cache (see `backends.protocol`); logits [len(tokens), vocab]. The cache
        holds every tree token until `accept_path`."""
        depth = tree_depths(parents)
        n, length = len(tokens), self.length
        if n == 0 or len(parents) != n:
            raise ValueError(f"forward_tree needs >= 1 token and one parent per token, got {n} and {len(parents)}")
        if length + max(depth) + 1 > self.max_length:
            raise ValueError(f"{self.name}: {length + max(depth) + 1} tokens exceed the context of {self.max_length}")
        sees = torch.zeros(n, length + n, dtype=torch.bool, device=self.device)
        sees[:, :length] = True
        for j in range(n):
            k = j
            while k >= 0:
                sees[j, length + k] = True
                k = parents[k]
        ids = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device).unsqueeze(0)
        positions = torch.as_tensor([length + d for d in depth], dtype=torch.long, device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, attention_mask=sees[None, None],
                         position_ids=positions)
        self._tree_base = length
        return out.logits[0]

    def accept_path(self, path: Sequence[int]) -> None:
        """After `forward_tree`: keep the cache before the tree plus the tree tokens `path` (indices
        of a root-to-node chain, in order), in that order; drop the other tree tokens."""
        base = self._tree_base
        if base is None:
            raise ValueError("accept_path() without a tree pass before it")
        keep = torch.as_tensor(list(range(base)) + [base + j for j in path], dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, keep)
                layer.values = layer.values.index_select(-2, keep)
        self._tree_base = None

    def truncate(self, length: int) -> None:
        self._tree_base = None
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        if length < self.length:
            self.cache.crop(length - self.length)  # negative: the number of tokens to remove
        if length == 0:
            self.cache = DynamicCache(config=self.model.config)

    def snapshot(self) -> Snapshot:
        """A copy of the cache (see `backends.protocol`)."""
        if self._tree_base is not None:
            raise ValueError("snapshot() during a tree pass: accept_path() or truncate() first")
        size = sum(t.numel() * t.element_size() for layer in self.cache.layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)
        return Snapshot(self.length, copy.deepcopy(self.cache), size)

    def restore(self, snapshot: Snapshot) -> None:
        """Replace the cache by a copy `snapshot()` made (of this sequence or a sibling)."""
        self._tree_base = None
        self.cache = copy.deepcopy(snapshot.data)

    def sibling(self) -> "HFModel":
        """Another sequence over the same weights (its own cache; passes are not shared: each
        sequence of a batch runs its own forward: docs/guide.md, "Max batch")."""
        return HFModel(self.model, self.name)



def _refuse_sliding_window(cache: DynamicCache, config, name: str) -> None:
    """Rolling back rejected drafts crops the cache, which needs every past K/V; a sliding-window
    layer drops K/V older than its window (its `crop` raises once the window fills). Refuse such
    models up front. The test is transformers' own: whether the cache it builds for this config
    has sliding layers (Qwen2 configs carry a sliding_window but use_sliding_window=False: none)."""
    sliding = [layer for layer in getattr(cache, "layers", []) if getattr(layer, "is_sliding", False)]
    if sliding:
        window = getattr(sliding[0], "sliding_window", None) or getattr(config, "sliding_window", None)
        raise ValueError(
            f"{name} uses sliding-window attention (window {window} in {len(sliding)} of "
            f"{len(cache.layers)} layers), which this backend cannot roll back after rejected drafts. "
            f"Use a model without sliding-window attention, or, when prompt plus output stay within "
            f"{window} tokens (where attention is the same), set \"sliding_window\": null (and "
            f"\"use_sliding_window\": false, or every entry of \"layer_types\" to \"full_attention\") "
            f"in its config.json")


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype, device: str,
                    name: str | None = None) -> tuple[HFModel, PreTrainedTokenizerBase]:
    """Load a local transformers model directory (config + weights + tokenizer).

    A broken directory (bad config.json, missing or truncated weights, no tokenizer files)
    raises ValueError with one line naming the problem and the fix, not a library traceback."""
    path = Path(path)
    check_model_dir(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(path / 'config.json')!r} is not a usable transformers config ({_first_line(exc)}); "
                         f"copy it again from the original model") from exc
    with quiet_progress():  # loading a converted directory takes seconds: no per-tensor bar
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot load the tokenizer in {str(path)!r} ({_first_line(exc)}); {_COPY_TOKENIZER}") \
                from exc
        if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
            raise ValueError(f"the tokenizer in {str(path)!r} has no vocabulary; {_COPY_TOKENIZER}")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
        except (OSError, ValueError, KeyError, SafetensorError) as exc:
            raise ValueError(f"cannot load the weights in {str(path)!r} ({_first_line(exc)}): they may be truncated "
                             f"or corrupt; copy them again from the original model") from exc
    return HFModel(model.to(device), name or path.name), tokenizer


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")
_COPY_TOKENIZER = ("copy the tokenizer files (tokenizer.json, tokenizer_config.json, ...) from the original model "
                   "into it, or save them there with tokenizer.save_pretrained(dir)")


def check_model_dir(path: Path) -> None:
    """The directory's own files, checked before transformers sees them (its errors are tracebacks
    about internals): a config.json that parses, weight files, tokenizer files."""
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist; pass a transformers model directory, "
                         f"a .gguf file, or omit it to use the embedded default")
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a transformers model directory (no config.json); pass a model "
                         f"directory or a .gguf file")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(path / 'config.json')!r} is not valid JSON ({_first_line(exc)}); copy it again "
                         f"from the original model") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{str(path / 'config.json')!r} is not a model config (a JSON object); copy it again "
                         f"from the original model")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"{str(path)!r} has a config.json but no weights ({' or '.join(WEIGHT_FILES[::2])}); "
                         f"copy the weight files from the original model into it")
    if not (any((path / f).is_file() for f in TOKENIZER_FILES) or any(path.glob("*.tiktoken"))):
        raise ValueError(f"{str(path)!r} has no tokenizer files; {_COPY_TOKENIZER}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@contextmanager
def quiet_progress():
    """Silence transformers' progress bars for the block, restoring the previous setting."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
