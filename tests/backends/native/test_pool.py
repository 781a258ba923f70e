"""The kernels' thread pool: a region dispatched the moment the pool exists runs on every worker.

A worker thread may first run after its pool's first region was dispatched (thread start takes
milliseconds on a busy machine); it used to take that region's generation as already seen and sleep
through it, its dispatcher spinning for it for ever: the first repack of a load hung on a busy
2-core machine. Each pool here dispatches at once, before its threads can have started; the loop
runs in a child process so that a hang fails the test instead of stopping the suite."""

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import numpy as np
    from specdecode.backends.native import library
    from tests.backends.native import ggml

    lib = library.library()
    data = ggml.quantize(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32), ggml.Q8_0)
    for _ in range(200):
        pool = lib.sd_pool_new(2)
        matrix = lib.sd_matrix_new(pool, ggml.Q8_0, 64, 256, data.ctypes.data, None, 0)
        assert matrix
        lib.sd_matrix_free(matrix)
        lib.sd_pool_free(pool)
    print("done")
""")


def test_a_region_dispatched_before_the_workers_start_runs_on_them():
    try:  # 200 pools take well under a second; the old pool hung on its first
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("a new pool's first region never finished: a worker slept through it") from None
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr
