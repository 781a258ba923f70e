"""A GGUF model loaded into our own kernels: its weights repacked once, the Qwen2 forward pass in C++.

`NativeWeights` holds the repacked matrices and runs passes; each `NativeModel` (model.py) is one
sequence (a KV cache) over it. Weights keep their GGUF quantisation (Q4_K, Q6_K, Q5_0, Q8_0), so the
model is the GGUF's: activations are quantised as llama.cpp does (csrc/reference.h) and every dot
product's integer part is llama.cpp's.

A pass's logits for a token depend only on the token's context, never on what else is in the pass:
each activation row is quantised on its own, each output is accumulated in a fixed order, and the
attention of each token runs alone. So a K-token pass equals K one-token passes bit for bit, and a
batch equals its rows run apart.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specdecode.backends.cpu import default_threads
from specdecode.backends.native import library as lib_
from specdecode.backends.native.gguf_layout import Layout, read_layout
from specdecode.checks import SettingError
from specdecode.interrupts import ctrl_c_after

ARCHITECTURES = ("qwen2",)
MATRIX_TYPES = {6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
VECTOR_TYPES = {0: "F32"}
EMBEDDING_TYPES = {0: "F32", 1: "F16", **MATRIX_TYPES}
TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}

LAYER_MATRICES = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
                  "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
LAYER_VECTORS = {"attn_norm.weight": "attn_norm", "ffn_norm.weight": "ffn_norm",
                 "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv"}


def why_not_native(layout: Layout) -> str | None:
    """Why the native backend cannot run the model of `layout` (its architecture, or a tensor of a type
    our kernels do not read), or None; read from the GGUF's tensor table alone, so that
    `--backend auto` can choose llama.cpp before loading anything."""
    if layout.architecture not in ARCHITECTURES:
        return f"the native backend runs the {', '.join(ARCHITECTURES)} architecture, not {layout.architecture}"
    for tensor in layout.tensors.values():
        kinds = EMBEDDING_TYPES if tensor.name == "token_embd.weight" else \
            MATRIX_TYPES if tensor.name.endswith(".weight") and len(tensor.shape) == 2 else VECTOR_TYPES
        if tensor.type not in kinds:
            return (f"its tensor {tensor.name} is {TYPE_NAMES.get(tensor.type, f'type {tensor.type}')}, which the "
                    f"native kernels do not read (they read {', '.join(dict.fromkeys(kinds.values()))})")
    return None


@dataclass(frozen=True, slots=True)
class NativeSettings:
    """How the native backend runs a model.

    n_ctx: tokens per sequence (0 = the model's trained context; the cache grows as it is used).
    n_threads: worker threads (0 = the machine's cores; the calling thread is one of them).
    kernel: the kernels' instruction set ("auto" = the fastest this CPU runs; "avx512-vnni", "avx-vnni",
    "avx2", or "reference", the plain oracle: slow, for tests).
    head_tokens: 0 = the whole output head; n = logits for the n most frequent tokens only, -inf for
    the rest (a cheaper draft: q is whatever the draft computed, so exactness is unaffected; never for
    a target, whose p it would change).
    n_batch: the most tokens one pass runs (a longer prompt goes in pieces of this size).
    """

    n_ctx: int = 0
    n_threads: int = 0
    kernel: str = "auto"
    head_tokens: int = 0
    n_batch: int = 512

    def threads(self) -> int:
        return self.n_threads or default_threads()


class Pool:
    """The kernels' worker threads (one set per process and thread count: two pools on the same
    cores would spin against each other, as two engines' thread pools do)."""

    def __init__(self, threads: int) -> None:
        self.lib = lib_.library()
        self.threads = threads
        self.ptr = lib_.check(self.lib.sd_pool_new(threads), "starting the kernels' threads")
        self.lock = threading.Lock()  # one parallel region at a time: a pass of whichever model holds it

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.sd_pool_free(self.ptr)
            self.ptr = None


@functools.cache
def shared_pool(threads: int) -> Pool:
    """The process's pool for `threads` workers (a target and its draft share it)."""
    return Pool(threads)


class NativeWeights:
    """A GGUF model in our kernels' layout. `forward_rows` runs rows of several sequences in one pass."""

    def __init__(self, path: str | os.PathLike, settings: NativeSettings = NativeSettings(), name: str | None = None,
                 cache: Path | None = None, keep_tokens: Sequence[int] | None = None, progress: bool = False) -> None:
        self.lib = lib = lib_.library()
        self.path, self.settings = Path(path), settings
        self.name = name or self.path.stem
        _check_settings(settings)
        self.kernel = lib_.kernel_name(settings.kernel)
        layout = read_layout(self.path, cache)
        if layout.architecture not in ARCHITECTURES:
            raise ValueError(f"{self.name}: {why_not_native(layout)} (use the llama.cpp backend)")
        self.layout = layout
        self.n_layer = int(layout.field("block_count"))
        self.n_embd = int(layout.field("embedding_length"))
        self.n_head = int(layout.field("attention.head_count"))
        self.n_kv = int(layout.field("attention.head_count_kv", self.n_head))
        self.n_ff = int(layout.field("feed_forward_length"))
        self.n_ctx_train = int(layout.field("context_length"))
        embd = self._tensor("token_embd.weight")
        self.n_vocab = int(embd.shape[1])
        eps = float(layout.field("attention.layer_norm_rms_epsilon"))
        rope_base = float(layout.field("rope.freq_base", 10000.0))
        if not 0 <= settings.n_ctx <= self.n_ctx_train:
            raise SettingError(f"{{n_ctx}} must be 0 (the model's) to {self.name}'s trained context of "
                               f"{self.n_ctx_train} tokens, got {settings.n_ctx}")
        self.max_length = settings.n_ctx or self.n_ctx_train
        self.file = np.memmap(self.path, dtype=np.uint8, mode="r")  # the embeddings are read from it per token
        self.pool = shared_pool(settings.threads())
        self.ptr = lib_.check(lib.sd_model_new(self.pool.ptr, settings.kernel.encode(), self.n_layer, self.n_embd,
                                               self.n_head, self.n_kv, self.n_ff, self.n_vocab, eps, rope_base),
                              f"{self.name}: the native backend cannot run this model")
        t0 = time.perf_counter()
        with ctrl_c_after():  # a Ctrl-C mid-repack lands once the C calls return
            self._load(keep_tokens, progress)
        self.load_seconds = time.perf_counter() - t0
        self.head_tokens = len(keep_tokens) if keep_tokens is not None else self.n_vocab
        self.nbytes = self.path.stat().st_size

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.sd_model_free(self.ptr)
            self.ptr = None

    def _tensor(self, name: str):
        tensor = self.layout.tensors.get(name)
        if tensor is None:
            raise ValueError(f"{self.name} has no tensor {name}, which the {self.layout.architecture} forward pass needs")
        return tensor

    def _data(self, tensor) -> np.ndarray:
        end = tensor.offset + tensor.nbytes
        if end > self.file.size:
            raise ValueError(f"{str(self.path)!r} is cut short: tensor {tensor.name} ends at byte {end}, the file has "
                             f"{self.file.size}; copy or download it again")
        return self.file[tensor.offset:end]

    def _vector(self, layer: int, slot: str, name: str) -> None:
        tensor = self._tensor(name)
        if tensor.type not in VECTOR_TYPES:
            raise ValueError(f"{self.name}: {name} is {TYPE_NAMES.get(tensor.type, tensor.type)}, the native backend "
                             f"reads F32 vectors (use the llama.cpp backend)")
        data = np.ascontiguousarray(self._data(tensor).view(np.float32))
        lib_.check(self.lib.sd_model_set_vector(self.ptr, layer, slot.encode(), data.ctypes.data, data.size),
                   f"{self.name}: {name}")

    def _matrix(self, layer: int, slot: str, name: str, ids: np.ndarray | None = None) -> None:
        tensor = self._tensor(name)
        if tensor.type not in MATRIX_TYPES or len(tensor.shape) != 2 or \
                not self.lib.sd_packable(tensor.type, tensor.shape[0]):
            raise ValueError(f"{self.name}: {name} is {TYPE_NAMES.get(tensor.type, f'type {tensor.type}')} "
                             f"{'x'.join(map(str, tensor.shape))}; the native kernels take "
                             f"{', '.join(MATRIX_TYPES.values())} matrices (use the llama.cpp backend)")
        data = self._data(tensor)
        cols, rows = tensor.shape
        with self.pool.lock:  # repacking runs on the pool's threads
            ptr = lib_.check(self.lib.sd_matrix_new(self.pool.ptr, tensor.type, rows, cols, data.ctypes.data,
                                                    None if ids is None else ids.ctypes.data,
                                                    0 if ids is None else ids.size), f"{self.name}: repacking {name}")
        if self.lib.sd_model_set_matrix(self.ptr, layer, slot.encode(), ptr) != 0:
            self.lib.sd_matrix_free(ptr)
            lib_.check(-1, f"{self.name}: {name}")

    def _load(self, keep_tokens, progress: bool) -> None:
        from tqdm.auto import tqdm

        embd = self._tensor("token_embd.weight")
        if embd.type not in EMBEDDING_TYPES:
            raise ValueError(f"{self.name}: token_embd is {TYPE_NAMES.get(embd.type, embd.type)}, which the native "
                             f"backend does not read (use the llama.cpp backend)")
        lib_.check(self.lib.sd_model_set_embedding(self.ptr, embd.type, self._data(embd).ctypes.data,
                                                   embd.shape[1], embd.shape[0]), f"{self.name}: token_embd")
        for layer in tqdm(range(self.n_layer), desc=f"repacking {self.name}", unit="layer", disable=not progress):
            for gguf, slot in LAYER_VECTORS.items():
                self._vector(layer, slot, f"blk.{layer}.{gguf}")
            for gguf, slot in LAYER_MATRICES.items():
                self._matrix(layer, slot, f"blk.{layer}.{gguf}.weight")
        self._vector(-1, "out_norm", "output_norm.weight")
        head = "output.weight" if "output.weight" in self.layout.tensors else "token_embd.weight"  # tied embeddings
        ids = None
        if keep_tokens is not None:
            ids = np.unique(np.asarray(keep_tokens, dtype=np.int32))
            ids = ids[ids < self.n_vocab]  # a tokenizer may name ids past the model's logits: never emitted
            if ids.size == 0 or ids[0] < 0:
                raise ValueError(f"the kept head tokens must be ids in [0, {self.n_vocab})")
        self._matrix(-1, "output", head, ids)
        lib_.check(self.lib.sd_model_check(self.ptr), f"{self.name}")

    def new_sequence(self) -> int:
        return lib_.check(self.lib.sd_seq_new(self.ptr), f"{self.name}: a new sequence")

    def forward_rows(self, seqs: Sequence[int], tokens: Sequence[Sequence[int]], n_logits: Sequence[int],
                     parents: Sequence[Sequence[int] | None]) -> list[torch.Tensor]:
        """One pass over rows (sequence handle, its tokens, logits for its last n_logits, its tree's
        parents or None): each row's logits [n_logits, vocab]."""
        n = len(seqs)
        counts = np.array([len(t) for t in tokens], dtype=np.int32)
        flat = np.fromiter((int(x) for row in tokens for x in row), dtype=np.int32, count=int(counts.sum()))
        tree = np.array([p is not None for p in parents], dtype=np.int32)
        par = np.full(flat.size, -1, dtype=np.int32)
        offset = 0
        for row, p in zip(tokens, parents):
            if p is not None:
                par[offset:offset + len(row)] = p
            offset += len(row)
        want = np.array(n_logits, dtype=np.int32)
        logits = torch.empty((int(want.sum()), self.n_vocab), dtype=torch.float32)
        handles = (ctypes.c_void_p * n)(*seqs)
        with self.pool.lock:  # the pool is shared with the process's other models (a draft, siblings)
            rc = self.lib.sd_forward(self.ptr, n, handles, counts.ctypes.data, flat.ctypes.data, tree.ctypes.data,
                                     par.ctypes.data, want.ctypes.data, logits.data_ptr())
        lib_.check(rc, f"{self.name}: forward pass")
        return list(torch.split(logits, [int(w) for w in want]))


def _check_settings(s: NativeSettings) -> None:
    for field in ("n_ctx", "n_threads", "head_tokens"):
        value = getattr(s, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{field} must be an integer >= 0, got {value!r}")
    if not isinstance(s.n_batch, int) or isinstance(s.n_batch, bool) or s.n_batch < 1:
        raise ValueError(f"n_batch must be an integer >= 1, got {s.n_batch!r}")
    if s.n_threads > 512:
        raise ValueError(f"n_threads must be at most 512 (this machine has {default_threads()} cores), "
                         f"got {s.n_threads}")
