"""The native kernels' shared library (built from csrc/ by the install), loaded with ctypes.

`library()` loads it once per process and declares every function's signature; `available()`
says whether this machine can run it, and if not, why, in one line (not built, not x86-64, a CPU
without AVX2). The C functions report failures through `sd_last_error`; `check` turns them into
ValueError (bad input) for the caller.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

HERE = Path(__file__).resolve().parent

# CPU flag bits reported by sd_cpu_flags (csrc/api.cpp)
AVX2, AVX_VNNI, AVX512_VNNI = 1, 2, 4
KERNELS = ("auto", "avx512-vnni", "avx-vnni", "avx2", "reference")

P = ctypes.c_void_p
I32, I64, F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float
CHARS = ctypes.c_char_p
SIGNATURES = {
    "sd_last_error": (CHARS, []),
    "sd_cpu_flags": (ctypes.c_int, []),
    "sd_act_k_bytes": (ctypes.c_int, []),
    "sd_act_32_bytes": (ctypes.c_int, []),
    "sd_kernel_name": (CHARS, [CHARS]),
    "sd_pool_new": (P, [ctypes.c_int]),
    "sd_pool_free": (None, [P]),
    "sd_matrix_new": (P, [P, ctypes.c_int, I64, I64, P, P, I64]),
    "sd_matrix_free": (None, [P]),
    "sd_matrix_bytes": (I64, [P]),
    "sd_packable": (ctypes.c_int, [ctypes.c_int, I64]),
    "sd_matmul": (ctypes.c_int, [P, CHARS, P, P, ctypes.c_int, P]),
    "sd_matmul_quantized": (ctypes.c_int, [P, CHARS, P, P, ctypes.c_int, P]),
    "sd_time_matmul": (ctypes.c_double, [P, CHARS, P, ctypes.c_int, P, ctypes.c_int, P, ctypes.c_int]),
    "sd_quantize": (ctypes.c_int, [CHARS, ctypes.c_int, P, I64, P]),
    "sd_dequantize": (ctypes.c_int, [ctypes.c_int, P, I64, P]),
    "sd_model_new": (P, [P, CHARS, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, I64, F32, F32]),
    "sd_model_free": (None, [P]),
    "sd_model_kernel": (CHARS, [P]),
    "sd_model_set_vector": (ctypes.c_int, [P, ctypes.c_int, CHARS, P, I64]),
    "sd_model_set_matrix": (ctypes.c_int, [P, ctypes.c_int, CHARS, P]),
    "sd_model_set_embedding": (ctypes.c_int, [P, ctypes.c_int, P, I64, I64]),
    "sd_model_check": (ctypes.c_int, [P]),
    "sd_seq_new": (P, [P]),
    "sd_seq_free": (None, [P]),
    "sd_seq_length": (I64, [P]),
    "sd_seq_truncate": (ctypes.c_int, [P, I64]),
    "sd_seq_keep": (ctypes.c_int, [P, P, P, ctypes.c_int]),
    "sd_seq_state_bytes": (I64, [P, P]),
    "sd_seq_state_get": (ctypes.c_int, [P, P, P]),
    "sd_seq_state_set": (ctypes.c_int, [P, P, P, I64, I64]),
    "sd_forward": (ctypes.c_int, [P, ctypes.c_int, P, P, P, P, P, P, P]),
}


def _library_path() -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = HERE / f"_kernels{suffix}"
        if path.is_file():
            return path
    return None


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded library (ValueError, in one line, where it cannot run here)."""
    why = unavailable()
    if why:
        raise ValueError(why)
    return _load()


@functools.cache
def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_library_path()))
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@functools.cache
def unavailable() -> str | None:
    """Why the native backend cannot run on this machine, or None if it can."""
    if _library_path() is None:
        return ("the native kernels were not built (the install compiles them from "
                "specdecode/backends/native/csrc; reinstall with a C++20 compiler: pip install -e .)")
    try:
        flags = _load().sd_cpu_flags()
    except OSError as exc:
        return f"the native kernels could not be loaded ({exc}); reinstall: pip install -e ."
    if not flags & AVX2:
        return "this CPU has no AVX2 (with FMA and F16C), which the native kernels need"
    return None


def cpu_paths() -> list[str]:
    """The kernel paths this CPU runs, fastest first (the reference always)."""
    flags = library().sd_cpu_flags()
    paths = [name for name, bit in (("avx512-vnni", AVX512_VNNI), ("avx-vnni", AVX_VNNI), ("avx2", AVX2))
             if flags & bit]
    return paths + ["reference"]


def kernel_name(kernel: str) -> str:
    """The path `kernel` runs on this CPU ('auto' resolved); ValueError if the CPU cannot run it."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    name = library().sd_kernel_name(kernel.encode())
    if name is None:
        raise ValueError(f"this CPU cannot run the {kernel} kernels (it runs: {', '.join(cpu_paths())})")
    return name.decode()


def check(rc, what: str):
    """A C call's result: raise ValueError with the library's message on failure (-1 or a null handle)."""
    if rc is None or (isinstance(rc, int) and rc < 0 and not isinstance(rc, bool)):
        message = library().sd_last_error().decode(errors="replace")
        raise ValueError(f"{what}: {message}")
    return rc
