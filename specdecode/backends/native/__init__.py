"""Our own CPU backend for GGUF models: the GGUF's quantised weights repacked once into tiles that a
pass of 1 to 32 tokens streams from memory once, multiplied with VNNI (AVX-512 or AVX-VNNI) or AVX2
kernels chosen from the CPU's flags, and the Qwen2 forward pass around them, in C++ (csrc/).

- library.py: the compiled kernels (ctypes), and why they cannot run here if they cannot;
- gguf_layout.py: a GGUF file's settings and tensor offsets (read once with the gguf package);
- weights.py: a model loaded into the kernels' layout, running passes;
- model.py: one sequence over it, the engine's Model protocol.
"""

from specdecode.backends.native.library import unavailable
from specdecode.backends.native.model import NativeModel
from specdecode.backends.native.weights import NativeSettings, NativeWeights

__all__ = ["NativeModel", "NativeSettings", "NativeWeights", "unavailable"]
