import pytest

from specdecode.backends.native import library

WHY = library.unavailable()
if WHY:  # the kernels are built by the install; a machine without AVX2 cannot run them
    pytest.skip(f"native backend unavailable: {WHY}", allow_module_level=True)
