"""A llama.cpp backend: the GGUF's own quantised kernels under our exact engine.

Runs a GGUF file as it is (no dequantisation) through llama-cpp-python's low-level
API: one `llama_decode` per pass, with logits requested for exactly the positions
the engine verifies, and rollback by `llama_memory_seq_rm` (removing the cache
entries of positions >= length is all a rejected draft costs).

The weights (`LlamaWeights`) are loaded once and memory-mapped; each `LlamaCppModel`
is one sequence of a `LlamaContext`. A context holds up to `n_seq_max` sequences,
each token of a batch tagged with its sequence id, so several sequences share one
pass (batching: `LlamaContext.forward_rows`).

A draft tree is one pass too. llama.cpp masks attention by sequence id (a token sees the cells
of its first sequence id at positions <= its own), so each leaf of the tree gets a scratch
sequence id: the cache is copied into every branch (`llama_memory_seq_cp` only tags cells, it
copies no K/V in a unified cache), each tree token is tagged with the branches through it, and
afterwards the accepted path's cells are tagged with the sequence and the branches removed.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specdecode.backends.cpu import default_threads
from specdecode.backends.protocol import Model, Row, Snapshot
from specdecode.checks import SettingError
from specdecode.core.tree import tree_depths
from specdecode.interrupts import ctrl_c_after

_init_lock = threading.Lock()
# Process-wide, as llama.cpp's own backend state is: initialised once, on first use.
_initialised = False
_log_errors_only = None  # the ctypes log callback, kept alive here (llama.cpp holds a raw pointer to it)


def _lib():
    """The llama.cpp binding, imported on first use (it is only needed for GGUF on this backend)."""
    global _initialised, _log_errors_only
    try:
        from llama_cpp import llama_cpp as ll
    except ImportError as exc:  # pragma: no cover - the package is a dependency
        raise SettingError("the llama.cpp backend needs llama-cpp-python: pip install 'llama-cpp-python==0.3.36' "
                           "(or use {backend=transformers})") from exc
    with _init_lock:
        if not _initialised:
            _log_errors_only = ll.llama_log_callback(_print_errors)
            ll.llama_backend_init()
            ll.llama_log_set(_log_errors_only, ctypes.c_void_p(0))
            _initialised = True
    return ll


def amx_build(ll) -> bool:
    """Whether this llama.cpp build would put weights into its AMX buffer type (built for an Intel CPU
    with AMX). llama-cpp-python 0.3.36's AMX path crashed the process (a segfault in libggml-cpu at the
    first pass) on a 2-core Xeon VM with AMX, so weights then load without llama.cpp's extra buffer
    types. That costs nothing there: with AMX present, the Q4_K weights were not repacked anyway (only
    the AMX buffer takes tensors; docs/measurements-xeon.md)."""
    return b"AMX_INT8 = 1" in ll.llama_print_system_info()


def _print_errors(level: int, text: bytes, user_data) -> None:
    """llama.cpp's log: keep errors (GGML_LOG_LEVEL_ERROR = 4), drop its loading chatter."""
    if level == 4:
        sys.stderr.write(text.decode("utf-8", errors="replace"))


def yield_torch_threads() -> None:
    """Give the cores to llama.cpp: torch keeps one thread in this process.

    Next to llama.cpp the engine's torch work is per-token vocabulary math (softmax, sampling:
    well under a millisecond on one core), and torch's idle worker threads spin on the cores
    llama.cpp's threads need: measured 17.1 vs 18.0 tokens/s for plain decoding with 2 vs 1
    torch threads on the 2-core CPU. Process-wide, like the rule "one engine per process".
    """
    torch.set_num_threads(1)


MAX_THREADS = 512  # GGML_MAX_N_THREADS: llama.cpp aborts the process (std::bad_alloc) far above it


@dataclass(frozen=True, slots=True)
class LlamaSettings:
    """How a llama.cpp context is built.

    n_ctx is the context of each sequence (0 = the model's trained context, capped so that all
    n_seq_max sequences together hold at most max_ctx tokens: the KV cache is allocated up
    front, f16 ~28 KB a token for the 1.5B target). n_seq_max sequences share one context and
    run in one pass (batching). The KV cache is unified (one pool of n_seq_max * n_ctx cells):
    with a cache split per sequence, llama.cpp runs a separate ubatch per sequence, and 4
    one-token rows cost 3.6 single steps instead of 1.9 (docs/guide.md, "Max batch"). Each sequence is held
    to n_ctx tokens by the engine, so the pool never runs out. The price is that attention
    spans the cells of all sequences: without flash attention every token's scores are computed
    over all of them (4 sequences of 200-800 tokens: 15-30% of a pass), while the CPU's flash
    attention skips the cells its mask hides. Hence flash attention on, as llama.cpp's own
    server does by default (docs/measurements-epyc.md, "The cost curve").
    """

    n_ctx: int = 0
    max_ctx: int = 32768
    n_batch: int = 512  # tokens per llama_decode call (the prompt is fed in pieces of this size)
    n_threads: int = 0  # 0 = default_threads()
    flash_attn: bool = True  # as fast alone, up to 20% faster with several sequences (docs/guide.md)
    n_seq_max: int = 1
    tree_leaves: int = 8  # scratch sequence ids per sequence: the most leaves a draft tree may have

    def threads(self) -> int:
        return self.n_threads or default_threads()


class LlamaWeights:
    """A GGUF file loaded (memory-mapped) once; contexts over it are cheap."""

    def __init__(self, path: str | os.PathLike, name: str | None = None) -> None:
        ll = _lib()
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"GGUF file {str(path)!r} does not exist")
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = not amx_build(ll)
        self.ll, self.path, self.name = ll, path, name or path.stem
        with ctrl_c_after():  # else a Ctrl-C lands in the log callback and is lost
            self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise SettingError(f"llama.cpp could not load {str(path)!r}: not a GGUF model it supports "
                               f"(try {{backend=transformers}})")
        self.vocab = ll.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self.ptr))

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.ll.llama_model_free(self.ptr)
            self.ptr = None

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """llama.cpp's own tokenizer (parse_special: special-token text becomes its id, as in HF)."""
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (self.ll.llama_token * cap)()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, True)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            buf = (self.ll.llama_token * cap)()
            n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, True)
        return list(buf[:n])

    def detokenize(self, tokens: Sequence[int]) -> str:
        arr = (self.ll.llama_token * len(tokens))(*tokens)
        cap = 8 * len(tokens) + 64
        buf = ctypes.create_string_buffer(cap)
        # remove_special=False, unparse_special=True: special tokens as their text, as HF's decode does
        n = self.ll.llama_detokenize(self.vocab, arr, len(tokens), buf, cap, False, True)
        if n < 0:
            cap = -n
            buf = ctypes.create_string_buffer(cap)
            n = self.ll.llama_detokenize(self.vocab, arr, len(tokens), buf, cap, False, True)
        return buf.raw[:n].decode("utf-8", errors="replace")


class LlamaContext:
    """One llama.cpp context over `weights`: n_seq_max sequences, each with its own cache, that
    can be decoded together in one `llama_decode` (`forward_rows`)."""

    def __init__(self, weights: LlamaWeights, settings: LlamaSettings = LlamaSettings()) -> None:
        ll = weights.ll
        if settings.n_seq_max < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {settings.n_seq_max}")
        self.ll, self.weights, self.settings = ll, weights, settings
        trained = weights.n_ctx_train or settings.max_ctx
        # beyond it llama.cpp wrapped 2^32 to a small context, aborted on 2^32 + a little, or ran out of memory
        if not 0 <= settings.n_ctx <= trained:
            raise SettingError(f"{{n_ctx}} must be 0 (the model's) to {weights.name}'s trained context of "
                               f"{trained} tokens, got {settings.n_ctx}")
        per_seq = settings.n_ctx or min(trained, settings.max_ctx // settings.n_seq_max)
        params = ll.llama_context_default_params()
        params.n_ctx = per_seq * settings.n_seq_max
        params.n_batch = params.n_ubatch = settings.n_batch
        if settings.tree_leaves < 0:
            raise ValueError(f"tree_leaves must be >= 0, got {settings.tree_leaves}")
        params.n_seq_max = settings.n_seq_max * (1 + settings.tree_leaves)  # sequences, then their scratch ids
        if params.n_seq_max > ll.llama_max_parallel_sequences():
            raise ValueError(f"{settings.n_seq_max} sequences x (1 + {settings.tree_leaves} tree leaves) exceed "
                             f"llama.cpp's {ll.llama_max_parallel_sequences()} sequence ids: lower the batch or "
                             f"the tree")
        if settings.n_batch < params.n_seq_max:  # llama.cpp reserves one output per sequence id (else it aborts)
            raise ValueError(f"n_batch={settings.n_batch} is below the context's {params.n_seq_max} sequence ids "
                             f"({settings.n_seq_max} sequences x (1 + {settings.tree_leaves} tree leaves)): raise "
                             f"n_batch or lower the batch or the tree")
        # llama.cpp clamps n_batch to the pool and reserves an output per sequence id, so a pool smaller
        # than the ids (n_ctx=1 with 9 ids) aborted the process; the engine still holds each sequence
        # to per_seq tokens (max_length), so a larger pool changes nothing else
        params.n_ctx = max(params.n_ctx, params.n_seq_max)
        params.kv_unified = True  # one ubatch for all sequences (see LlamaSettings)
        if not 1 <= settings.threads() <= MAX_THREADS:
            raise ValueError(f"threads must be 1 to {MAX_THREADS} (this machine has {default_threads()} cores), "
                             f"got {settings.threads()}")
        params.n_threads = params.n_threads_batch = settings.threads()
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn \
            else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        with ctrl_c_after():  # else a Ctrl-C lands in the log callback and is lost
            self.ctx = ll.llama_init_from_model(weights.ptr, params)
        if not self.ctx:
            raise ValueError(f"llama.cpp could not create a context of {settings.n_seq_max} x {per_seq} tokens "
                             f"for {weights.name} (out of memory? lower the context size or the batch)")
        self.max_length = min(per_seq, int(ll.llama_n_ctx_seq(self.ctx)))  # per sequence
        self.memory = ll.llama_get_memory(self.ctx)
        self._batch = ll.llama_batch_init(settings.n_batch, 0, 1 + settings.tree_leaves)
        self.views: list[LlamaCppModel | None] = [None] * settings.n_seq_max

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            self.ll.llama_batch_free(self._batch)
            self.ll.llama_free(self.ctx)
            self.ctx = None

    def forward_rows(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Run each row's tokens after its sequence's cache, all rows in one pass when they fit in
        n_batch (else in consecutive passes; a row longer than n_batch goes in pieces; a tree row
        never does); return each row's logits [n_logits, vocab] for its last n_logits tokens (every
        token of a tree row)."""
        rows = [Row(*row) for row in rows]
        trees: dict[int, _Tree] = {}
        for r, (model, tokens, n_logits, parents) in enumerate(rows):
            n = len(tokens)
            if model.context is not self:
                raise ValueError(f"{model.name} is a sequence of another llama.cpp context")
            if n == 0 or not 1 <= n_logits <= n:
                raise ValueError(f"forward needs >= 1 token and 1 <= n_logits <= {n}, got {n} tokens, "
                                 f"n_logits={n_logits}")
            if parents is not None:
                trees[r] = _Tree.of(model, parents, self.settings)
                n = max(trees[r].depth) + 1
            if model.length + n > self.max_length:
                raise SettingError(f"{model.name}: {model.length + n} tokens exceed the context of "
                                   f"{self.max_length} (raise {{n_ctx}})")
        if len({id(row.model) for row in rows}) != len(rows):
            raise ValueError("a pass holds each sequence at most once")
        # pieces: (row index, tokens, offset of the first token in the row); grouped into passes
        pieces = [(r, list(row.tokens[s:s + self.settings.n_batch]), s) for r, row in enumerate(rows)
                  for s in range(0, len(row.tokens), self.settings.n_batch)]
        for r, tree in trees.items():
            tree.begin(self, rows[r].model)
        out: list[list[np.ndarray]] = [[] for _ in rows]
        group: list = []
        for piece in pieces + [None]:
            if piece is None or sum(len(p[1]) for p in group) + len(piece[1]) > self.settings.n_batch:
                if group:
                    self._decode(rows, group, out)
                group = []
            if piece is not None:
                group.append(piece)
        # one position (a plain step's row): its copy as a [1, V] view, not a second V-sized copy
        return [torch.from_numpy(r[0][None] if len(r) == 1 else np.stack(r)) for r in out]

    def _decode(self, rows, group, out: list[list[np.ndarray]]) -> None:
        b, i = self._batch, 0
        wanted: list[tuple[int, int]] = []  # (row, batch index) whose logits are returned
        for r, chunk, offset in group:
            model, tokens, n_logits, parents = rows[r]
            tree = model._tree if parents is not None else None
            for j, tok in enumerate(chunk):
                b.token[i] = int(tok)
                if tree is None:
                    b.pos[i] = model.length + j
                    b.n_seq_id[i] = 1
                    b.seq_id[i][0] = model.seq_id
                else:  # the root is the sequence's own (and every branch's); a node, its branches'
                    ids = tree.seq_ids(j)
                    b.pos[i] = tree.base + tree.depth[j]
                    b.n_seq_id[i] = len(ids)
                    for s, seq in enumerate(ids):
                        b.seq_id[i][s] = seq
                b.logits[i] = offset + j >= len(tokens) - n_logits
                if b.logits[i]:
                    wanted.append((r, i))
                i += 1
        b.n_tokens = i
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            # rc 1: no KV slot; other codes: invalid input or a fatal error. Drop whatever was written.
            for r, _, _ in group:
                model = rows[r].model
                model._drop_tree()
                self.ll.llama_memory_seq_rm(self.memory, model.seq_id, model.length, -1)
            raise RuntimeError(f"{self.weights.name}: llama_decode failed with code {rc}")
        for r, chunk, _ in group:
            model = rows[r].model
            model._length += 1 if rows[r].parents is not None else len(chunk)  # a tree: the root only, so far
        for r, i in wanted:
            ptr = self.ll.llama_get_logits_ith(self.ctx, i)
            out[r].append(np.ctypeslib.as_array(ptr, shape=(self.weights.n_vocab,)).copy())


def _bytes(array: np.ndarray):
    """A uint8 array as the `uint8_t *` llama.cpp's state functions take."""
    return array.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


@dataclass
class _Tree:
    """A tree row's layout: each node's depth and the scratch sequence ids (branches) through it."""

    parents: list[int]
    depth: list[int]
    branches_of: list[list[int]]  # per node: the branch ids of the leaves below it (itself included)
    branch_ids: list[int]
    own_id: int
    base: int = 0  # the sequence's cache length before the tree (the root's position)

    @staticmethod
    def of(model: "LlamaCppModel", parents: Sequence[int], settings: LlamaSettings) -> "_Tree":
        if not parents or parents[0] != -1 or any(p < 0 for p in parents[1:]):
            raise ValueError("a tree row has one root, its first token (parents[0] = -1, every other parent >= 0)")
        depth = tree_depths(parents)
        if len(parents) > settings.n_batch:
            raise ValueError(f"a tree of {len(parents)} tokens exceeds n_batch={settings.n_batch}")
        inner = set(parents)
        leaves = [j for j in range(len(parents)) if j not in inner]
        if len(leaves) > len(model.scratch_ids):
            raise ValueError(f"a tree with {len(leaves)} leaves needs LlamaSettings(tree_leaves >= {len(leaves)}), "
                             f"this context has {len(model.scratch_ids)}")
        branches_of: list[list[int]] = [[] for _ in parents]
        for leaf, branch in zip(leaves, model.scratch_ids):
            node = leaf
            while node >= 0:
                branches_of[node].append(branch)
                node = parents[node]
        return _Tree(list(parents), depth, branches_of, model.scratch_ids[:len(leaves)], model.seq_id)

    def begin(self, context: "LlamaContext", model: "LlamaCppModel") -> None:
        """Every branch sees the sequence's cache; the model waits for accept_path."""
        model._drop_tree()
        self.base = model.length
        for branch in self.branch_ids:
            context.ll.llama_memory_seq_cp(context.memory, model.seq_id, branch, -1, -1)
        model._tree = self

    def seq_ids(self, j: int) -> list[int]:
        """Token j's sequence ids; the first decides what it attends to (its own branch's cells)."""
        return [self.own_id] + self.branch_ids if j == 0 else self.branches_of[j]


class LlamaCppModel(Model):
    """One sequence of a llama.cpp context over `weights`: the engine's `Model` protocol.

    Built alone it owns a new context (with settings.n_seq_max sequences); `sibling()` gives the
    context's other sequences, which `forward_batch` runs together in one pass.
    """

    trees = True  # scratch sequence ids per leaf (module docstring)
    snapshots = True  # llama_state_seq_get_data / set_data

    def __init__(self, weights: LlamaWeights, settings: LlamaSettings = LlamaSettings(),
                 name: str | None = None, *, context: LlamaContext | None = None, seq_id: int = 0) -> None:
        self.context = context if context is not None else LlamaContext(weights, settings)
        if not 0 <= seq_id < len(self.context.views) or self.context.views[seq_id] is not None:
            raise ValueError(f"sequence {seq_id} of this llama.cpp context is taken or out of range")
        self.context.views[seq_id] = self
        self.ll, self.weights, self.settings = weights.ll, weights, self.context.settings
        self.name = name or weights.name
        self.vocab_size = weights.n_vocab
        self.max_length = self.context.max_length
        self.context_setting = "n_ctx"  # the parameter named when a prompt does not fit
        self.seq_id = seq_id
        self.device = torch.device("cpu")
        # llama.cpp quantises activations per pass, so a K-token pass and K one-token passes (or a
        # batch and a lone row) round differently: logits move by up to ~0.6, and a near-tie of the
        # top two within this margin may flip (tests/backends/test_llamacpp.py)
        self.logit_tolerance = 0.25
        self._length = 0
        self._tree: _Tree | None = None  # a tree pass awaiting accept_path
        # scratch sequence ids for draft trees: after the context's n_seq_max sequences, tree_leaves each
        first = self.settings.n_seq_max + seq_id * self.settings.tree_leaves
        self.scratch_ids = list(range(first, first + self.settings.tree_leaves))

    @property
    def length(self) -> int:
        return self._length

    @property
    def signature(self) -> str:
        """What this model's speed depends on (the calibration cache's key)."""
        s = self.settings
        return f"llama.cpp {self.weights.name} ({self.weights.path.stat().st_size} B) threads={s.threads()} " \
               f"flash_attn={s.flash_attn} n_batch={s.n_batch}"

    def forward(self, tokens: Sequence[int], n_logits: int = 1) -> torch.Tensor:
        return self.context.forward_rows([(self, tokens, n_logits)])[0]

    @property
    def batch_group(self) -> LlamaContext:
        return self.context  # its sequences share passes

    def forward_batch(self, rows: Sequence[Row]) -> list[torch.Tensor]:
        """Several sequences of this context in one pass (see `backends.protocol.forward_batch`)."""
        return self.context.forward_rows(rows)

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """A draft tree after the cache, in one pass (module docstring); logits for every token.
        The root (tokens[0]) joins the cache; the rest waits for `accept_path`."""
        return self.context.forward_rows([Row(self, tokens, len(tokens), parents)])[0]

    def accept_path(self, path: Sequence[int]) -> None:
        """After `forward_tree`: keep the root and the tree tokens `path` (a root-to-node chain of
        indices, root first) as this sequence's next cache positions; free the rest of the tree."""
        tree = self._tree
        if tree is None:
            raise ValueError("accept_path() without a tree pass before it")
        if not path or path[0] != 0 or any(tree.parents[b] != a for a, b in zip(path, path[1:])):
            raise ValueError(f"{list(path)} is not a root-to-node path of the tree")
        if len(path) > 1:  # the winning branch holds exactly one cell per position: the path's
            branch = tree.branches_of[path[-1]][0]
            self.ll.llama_memory_seq_cp(self.context.memory, branch, self.seq_id, tree.base + 1, tree.base + len(path))
        self._drop_tree()
        self._length = tree.base + len(path)

    def _drop_tree(self) -> None:
        """Forget a tree pass: its scratch sequence ids leave every cell (cells left with none are free)."""
        if self._tree is not None:
            for branch in self._tree.branch_ids:
                self.ll.llama_memory_seq_rm(self.context.memory, branch, -1, -1)
            self._tree = None

    def truncate(self, length: int) -> None:
        self._drop_tree()
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} tokens to {length}")
        if length < self._length:
            if not self.ll.llama_memory_seq_rm(self.context.memory, self.seq_id, length, -1):
                raise RuntimeError(f"{self.name}: llama.cpp could not remove cache positions >= {length}")
            self._length = length

    def snapshot(self) -> Snapshot:
        """A copy of this sequence's cells (see `backends.protocol`): ~28 KB a token for the 1.5B
        target, under a millisecond for a few hundred tokens."""
        self._drop_tree()
        ctx = self.context.ctx
        size = self.ll.llama_state_seq_get_size(ctx, self.seq_id)
        data = np.empty(size, dtype=np.uint8)
        if self.ll.llama_state_seq_get_data(ctx, _bytes(data), size, self.seq_id) != size:
            raise RuntimeError(f"{self.name}: llama.cpp could not copy the cache of sequence {self.seq_id}")
        return Snapshot(self._length, data, size)

    def restore(self, snapshot: Snapshot) -> None:
        """Replace this sequence's cache by a copy `snapshot()` made (of it or a sibling)."""
        self.truncate(0)
        data = snapshot.data
        if not isinstance(data, np.ndarray) or snapshot.length > self.max_length:
            raise ValueError(f"{self.name}: not a snapshot of this context's sequences")
        if self.ll.llama_state_seq_set_data(self.context.ctx, _bytes(data), data.size, self.seq_id) != data.size:
            self.ll.llama_memory_seq_rm(self.context.memory, self.seq_id, -1, -1)
            raise RuntimeError(f"{self.name}: llama.cpp could not restore {snapshot.length} cached positions "
                               f"(no room left in the cache?)")
        self._length = snapshot.length

    def sibling(self) -> "LlamaCppModel":
        """The next free sequence of this context (its own, empty cache; shares passes with this one)."""
        free = [i for i, v in enumerate(self.context.views) if v is None]
        if not free:
            raise ValueError(f"all {len(self.context.views)} sequences of {self.name}'s llama.cpp context are "
                             f"in use (build it with a larger n_seq_max)")
        return LlamaCppModel(self.weights, name=self.name, context=self.context, seq_id=free[0])
