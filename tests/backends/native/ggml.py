"""llama.cpp's own quantisation and dot products (its ggml libraries, as llama-cpp-python ships
them), called through ctypes: the other oracle the native kernels are tested against."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

P = ctypes.c_void_p
Q4_K, Q6_K, Q5_0, Q8_0 = 12, 14, 6, 8
NAMES = {Q4_K: "q4_K", Q6_K: "q6_K", Q5_0: "q5_0", Q8_0: "q8_0"}
BLOCK = {Q4_K: (256, 144), Q6_K: (256, 210), Q5_0: (32, 22), Q8_0: (32, 34)}  # weights, bytes
Q8K_BYTES, Q8_0_BYTES = 292, 34  # llama.cpp's block_q8_K (float d, int8 qs[256], int16 bsums[16]) and block_q8_0


@functools.cache
def libs():
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"))
    cpu.ggml_cpu_init()
    for kind in NAMES.values():
        fn = getattr(base, f"quantize_{kind}")
        fn.restype, fn.argtypes = ctypes.c_size_t, [P, P, ctypes.c_int64, ctypes.c_int64, P]
        fn = getattr(base, f"dequantize_row_{kind}")
        fn.restype, fn.argtypes = None, [P, P, ctypes.c_int64]
    for name in ("quantize_row_q8_K", "quantize_row_q8_0"):
        fn = getattr(cpu, name)
        fn.restype, fn.argtypes = None, [P, P, ctypes.c_int64]
    for kind in NAMES.values():
        fn = getattr(cpu, f"ggml_vec_dot_{kind}_{'q8_K' if kind.endswith('K') else 'q8_0'}")
        fn.restype = None
        fn.argtypes = [ctypes.c_int, P, ctypes.c_size_t, P, ctypes.c_size_t, P, ctypes.c_size_t, ctypes.c_int]
    return base, cpu


def quantize(w: np.ndarray, kind: int) -> np.ndarray:
    """Rows of float weights as llama.cpp quantises them: [rows, row bytes] of GGUF blocks."""
    rows, cols = w.shape
    qk, nbytes = BLOCK[kind]
    out = np.zeros((rows, cols // qk * nbytes), dtype=np.uint8)
    w = np.ascontiguousarray(w, dtype=np.float32)
    getattr(libs()[0], f"quantize_{NAMES[kind]}")(w.ctypes.data, out.ctypes.data, rows, cols, None)
    return out


def dequantize(row: np.ndarray, kind: int, cols: int) -> np.ndarray:
    out = np.zeros(cols, dtype=np.float32)
    row = np.ascontiguousarray(row)
    getattr(libs()[0], f"dequantize_row_{NAMES[kind]}")(row.ctypes.data, out.ctypes.data, cols)
    return out


def quantize_activations(x: np.ndarray, k_quant: bool) -> np.ndarray:
    """llama.cpp's quantisation of one activation row: block_q8_K for K-quants, block_q8_0 else."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.size // (256 if k_quant else 32) * (Q8K_BYTES if k_quant else Q8_0_BYTES), dtype=np.uint8)
    getattr(libs()[1], "quantize_row_q8_K" if k_quant else "quantize_row_q8_0")(x.ctypes.data, out.ctypes.data, x.size)
    return out


def vec_dot(row: np.ndarray, kind: int, x: np.ndarray) -> float:
    """llama.cpp's dot product of one GGUF row with activations x (quantised as it does)."""
    k_quant = kind in (Q4_K, Q6_K)
    y = quantize_activations(x, k_quant)
    return vec_dot_quantized(row, kind, y, x.size)


def vec_dot_quantized(row: np.ndarray, kind: int, y: np.ndarray, cols: int) -> float:
    s = ctypes.c_float()
    row = np.ascontiguousarray(row)
    fn = getattr(libs()[1], f"ggml_vec_dot_{NAMES[kind]}_{'q8_K' if kind in (Q4_K, Q6_K) else 'q8_0'}")
    fn(cols, ctypes.byref(s), 0, row.ctypes.data, 0, y.ctypes.data, 0, 1)
    return s.value
