"""One repacked matrix and the kernels on it, outside a model: for the kernel tests and the
per-projection benchmark (benchmarks/frontier.py)."""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from specdecode.backends.native import library as lib_
from specdecode.backends.native.weights import Pool

K_QUANTS = (12, 14)  # Q4_K, Q6_K: activations per 256 (the others per 32)
BLOCK_WEIGHTS = {12: 256, 14: 256, 6: 32, 8: 32}


class PackedMatrix:
    """`data`: the GGUF rows of a rows x cols matrix of ggml type `kind` ([rows, row bytes] uint8),
    kept alive here (the reference kernels read it)."""

    def __init__(self, pool: Pool, kind: int, data: np.ndarray, cols: int, ids: Sequence[int] | None = None) -> None:
        self.lib, self.pool, self.kind, self.cols = pool.lib, pool, kind, cols
        self.data = np.ascontiguousarray(data)
        self.ids = None if ids is None else np.ascontiguousarray(ids, dtype=np.int32)
        self.rows = len(self.ids) if self.ids is not None else self.data.shape[0]
        with pool.lock:
            self.ptr = lib_.check(self.lib.sd_matrix_new(pool.ptr, kind, self.data.shape[0], cols, self.data.ctypes.data,
                                                         None if self.ids is None else self.ids.ctypes.data,
                                                         0 if self.ids is None else self.ids.size), "repacking")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self.lib.sd_matrix_free(self.ptr)
            self.ptr = None

    @property
    def nbytes(self) -> int:
        """Bytes of the repacked tiles (what a pass streams)."""
        return int(self.lib.sd_matrix_bytes(self.ptr))

    def apply(self, x: np.ndarray, kernel: str = "auto") -> np.ndarray:
        """y[r, i] = row i . x[r] (x quantised as the matrix's type needs), on `kernel`'s path."""
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, self.cols)
        y = np.zeros((x.shape[0], self.rows), dtype=np.float32)
        with self.pool.lock:
            rc = self.lib.sd_matmul(self.pool.ptr, kernel.encode(), self.ptr, x.ctypes.data, x.shape[0], y.ctypes.data)
        lib_.check(rc, "matmul")
        return y

    def apply_quantized(self, acts: np.ndarray, n: int, kernel: str = "auto") -> np.ndarray:
        """`apply` with activations already quantised (`quantize_activations`' bytes, n rows)."""
        y = np.zeros((n, self.rows), dtype=np.float32)
        acts = np.ascontiguousarray(acts)
        with self.pool.lock:
            rc = self.lib.sd_matmul_quantized(self.pool.ptr, kernel.encode(), self.ptr, acts.ctypes.data, n,
                                              y.ctypes.data)
        lib_.check(rc, "matmul")
        return y


def activation_block_bytes(k_quant: bool) -> int:
    lib = lib_.library()
    return lib.sd_act_k_bytes() if k_quant else lib.sd_act_32_bytes()


def quantize_activations(x: np.ndarray, k_quant: bool, kernel: str = "auto") -> np.ndarray:
    """One row of activations as the kernels quantise it: ActK blocks (per 256) or Act32 (per 32), as bytes."""
    lib = lib_.library()
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    per = 256 if k_quant else 32
    out = np.zeros(x.size // per * activation_block_bytes(k_quant), dtype=np.uint8)
    lib_.check(lib.sd_quantize(kernel.encode(), 0 if k_quant else 1, x.ctypes.data, x.size, out.ctypes.data),
               "quantize")
    return out


def dequantize_row(kind: int, row: np.ndarray, cols: int) -> np.ndarray:
    lib = lib_.library()
    out = np.zeros(cols, dtype=np.float32)
    row = np.ascontiguousarray(row)
    lib_.check(lib.sd_dequantize(kind, row.ctypes.data, cols, out.ctypes.data), "dequantize")
    return out


def time_matmul(matrices: Sequence[PackedMatrix], n: int, kernel: str = "auto", reps: int = 5,
                seed: int = 0) -> float:
    """Seconds per matmul of n rows, the matrices in turn (more of them than the L3 holds: the weights
    come from memory), median of `reps` sweeps timed in C."""
    first = matrices[0]
    x = np.random.default_rng(seed).standard_normal((n, first.cols)).astype(np.float32)
    y = np.zeros((n, max(m.rows for m in matrices)), dtype=np.float32)
    handles = (ctypes.c_void_p * len(matrices))(*[m.ptr for m in matrices])
    with first.pool.lock:
        seconds = first.lib.sd_time_matmul(first.pool.ptr, kernel.encode(), handles, len(matrices), x.ctypes.data, n,
                                           y.ctypes.data, reps)
    if seconds < 0:
        lib_.check(-1, "timing")
    return float(seconds)
