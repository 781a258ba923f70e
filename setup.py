"""The native backend's kernels (specdecode/backends/native/csrc) are built here, as a shared library
that backends/native/library.py loads with ctypes. Every other setting lives in pyproject.toml.

The instruction-set paths (AVX-512 VNNI, AVX-VNNI, AVX2) are each compiled for their own target
inside one library and chosen at run time from the CPU's flags, so one build runs on every x86-64
machine. `optional=True`: where the C++ compiler fails, the install goes on and the native backend
reports that it was not built (the llama.cpp backend is used instead).
"""

from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("specdecode/backends/native/csrc")

setup(
    ext_modules=[
        Extension(
            "specdecode.backends.native._kernels",
            sources=sorted(str(p) for p in CSRC.glob("*.cpp")),
            depends=sorted(str(p) for p in CSRC.glob("*.h*")) + sorted(str(p) for p in CSRC.glob("*.inc")),
            language="c++",
            extra_compile_args=["-O3", "-std=c++20", "-ffp-contract=off", "-fvisibility=hidden",
                                "-Wno-maybe-uninitialized"],
            optional=True,
        )
    ]
)
