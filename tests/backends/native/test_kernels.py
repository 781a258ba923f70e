"""The native kernels against their plain reference (bit for bit) and against llama.cpp's own
quantisation and dot products, for every weight type the embedded pair holds, odd shapes, 1..32
rows, on every instruction-set path this CPU runs (the AVX2 path forced where AVX-512 exists)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from specdecode.backends.native import library
from specdecode.backends.native.matrix import (PackedMatrix, activation_block_bytes, dequantize_row,
                                               quantize_activations)
from specdecode.backends.native.weights import shared_pool
from tests.backends.native import ggml

TYPES = [ggml.Q4_K, ggml.Q6_K, ggml.Q5_0, ggml.Q8_0]
PATHS = [p for p in library.cpu_paths() if p != "reference"]  # the fast paths this CPU runs
K_QUANT = {ggml.Q4_K: True, ggml.Q6_K: True, ggml.Q5_0: False, ggml.Q8_0: False}


def pool():
    return shared_pool(2)


def weights(rng, rows, cols, kind):
    """Realistic GGUF blocks: random floats quantised by llama.cpp itself."""
    return ggml.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2), kind)


def test_this_cpu_runs_a_fast_path():
    assert PATHS, "a machine with AVX2 runs at least the avx2 path"
    assert library.kernel_name("auto") == PATHS[0]


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9, 16, 17, 32])
def test_every_path_equals_the_reference_bit_for_bit(kind, n):
    rng = np.random.default_rng(100 * kind + n)
    per = ggml.BLOCK[kind][0]
    rows, cols = 37, 3 * per  # 37 rows: two full tiles and a partial one
    m = PackedMatrix(pool(), kind, weights(rng, rows, cols, kind), cols)
    x = rng.standard_normal((n, cols)).astype(np.float32) * 3
    reference = m.apply(x, "reference")
    assert np.isfinite(reference).all() and np.abs(reference).max() > 0
    for path in PATHS:
        np.testing.assert_array_equal(m.apply(x, path), reference, err_msg=path)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(kind=st.sampled_from(TYPES), rows=st.integers(1, 70), blocks=st.integers(1, 5), n=st.integers(1, 32),
       seed=st.integers(0, 2**31))
def test_any_shape_equals_the_reference(kind, rows, blocks, n, seed):
    rng = np.random.default_rng(seed)
    cols = blocks * ggml.BLOCK[kind][0]
    m = PackedMatrix(pool(), kind, weights(rng, rows, cols, kind), cols)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    reference = m.apply(x, "reference")
    for path in PATHS:
        np.testing.assert_array_equal(m.apply(x, path), reference, err_msg=path)


def _integer_blocks(rng, kind, rows, cols):
    """GGUF blocks of random quants whose float scales are 1 (so a dot product is its integer part)."""
    data = weights(rng, rows, cols, kind).copy()
    qk, nbytes = ggml.BLOCK[kind]
    blocks = data.reshape(rows, cols // qk, nbytes)
    one = np.float16(1.0).view(np.uint16)
    body = rng.integers(0, 256, size=blocks.shape, dtype=np.uint8)
    if kind == ggml.Q4_K:     # d, dmin = 1; random 6-bit scales and mins, random nibbles
        blocks[:] = body
        blocks[..., 0:2] = np.frombuffer(one.tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(one.tobytes(), np.uint8)
    elif kind == ggml.Q6_K:   # ql, qh random; int8 scales in -64..63; d = 1 (last two bytes)
        blocks[:] = body
        blocks[..., 192:208] = rng.integers(-64, 64, size=blocks[..., 192:208].shape).astype(np.int8).view(np.uint8)
        blocks[..., 208:210] = np.frombuffer(one.tobytes(), np.uint8)
    else:                     # d = 1 first, then the quants
        blocks[:] = body
        blocks[..., 0:2] = np.frombuffer(one.tobytes(), np.uint8)
    return data


def _integer_activations(rng, kind, n, cols):
    """Activations quantised by the kernels, then their scale set to 1 (the quants stay as they are)."""
    k_quant = K_QUANT[kind]
    acts = np.concatenate([quantize_activations(rng.standard_normal(cols) * 5, k_quant, "reference") for _ in range(n)])
    size = activation_block_bytes(k_quant)
    view = acts.reshape(-1, size)
    view[:, 0:4] = np.frombuffer(np.float32(1.0).tobytes(), np.uint8)  # d is each block's first field
    return acts


@pytest.mark.parametrize("kind", TYPES)
def test_integer_parts_are_exact(kind):
    """With every float scale 1, each output is the exact integer sum of (weight x activation) quants:
    the kernels', the reference's and llama.cpp's agree with numpy's int64 arithmetic bit for bit."""
    rng = np.random.default_rng(kind)
    rows, cols, n = 21, 2 * ggml.BLOCK[kind][0], 7
    data = _integer_blocks(rng, kind, rows, cols)
    m = PackedMatrix(pool(), kind, data, cols)
    acts = _integer_activations(rng, kind, n, cols)
    # numpy: dequantised weights are integers (d = 1, dmin = 1); the activations' quants are int8
    w = np.stack([ggml.dequantize(data[i], kind, cols) for i in range(rows)]).astype(np.int64)
    size = activation_block_bytes(K_QUANT[kind])
    per = 256 if K_QUANT[kind] else 32
    q = acts.reshape(n, cols // per, size)[:, :, 4:4 + per].view(np.int8).reshape(n, cols).astype(np.int64)
    expected = (q @ w.T).astype(np.float64)
    assert np.abs(expected).max() < 2**24  # exact in float32
    for path in ["reference"] + PATHS:
        np.testing.assert_array_equal(m.apply_quantized(acts, n, path).astype(np.float64), expected, err_msg=path)
    # llama.cpp on the same blocks and the same quants (its activation blocks built from ours)
    for r in range(n):
        y = _ggml_activations(acts.reshape(n, -1)[r], kind, cols)
        got = [ggml.vec_dot_quantized(data[i], kind, y, cols) for i in range(rows)]
        np.testing.assert_array_equal(np.array(got, np.float64), expected[r])


def _ggml_activations(ours: np.ndarray, kind: int, cols: int) -> np.ndarray:
    """Our activation blocks in llama.cpp's layout (block_q8_K: d, qs, bsums; block_q8_0: fp16 d, qs)."""
    if K_QUANT[kind]:
        blocks = ours.reshape(cols // 256, activation_block_bytes(True))
        return np.ascontiguousarray(blocks[:, :ggml.Q8K_BYTES]).ravel()
    blocks = ours.reshape(cols // 32, activation_block_bytes(False))
    d = blocks[:, 0:4].copy().view(np.float32).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(np.concatenate([d, blocks[:, 4:36]], axis=1)).ravel()


@pytest.mark.parametrize("kind", TYPES)
def test_close_to_llama_cpp_on_real_values(kind):
    """On llama.cpp's own blocks of random weights and random activations, our result is llama.cpp's up
    to the order of float additions: |diff| <= 1e-5 |y| + 1e-4 (float32 sums over a few blocks)."""
    rng = np.random.default_rng(kind + 7)
    rows, cols, n = 33, 4 * ggml.BLOCK[kind][0], 3
    data = weights(rng, rows, cols, kind)
    m = PackedMatrix(pool(), kind, data, cols)
    x = rng.standard_normal((n, cols)).astype(np.float32) * 2
    ours = m.apply(x)
    theirs = np.array([[ggml.vec_dot(data[i], kind, x[r]) for i in range(rows)] for r in range(n)], np.float32)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-4)
    assert not np.array_equal(np.round(ours, 1), np.zeros_like(ours))


@pytest.mark.parametrize("k_quant", [True, False])
@pytest.mark.parametrize("path", ["reference"] + PATHS)
def test_activation_quantisation_is_llama_cpps(k_quant, path):
    """Byte for byte, including zeros, ties (.5 after scaling) and a largest magnitude met twice."""
    rng = np.random.default_rng(3)
    for trial in range(40):
        cols = 256 * int(rng.integers(1, 5))
        x = (rng.standard_normal(cols) * rng.uniform(1e-3, 1e3)).astype(np.float32)
        if trial % 4 == 1:
            x[: cols // 2] = 0
        if trial % 4 == 2:
            x = np.round(x * 4) / 4
        if trial % 4 == 3:
            x[10] = -x[200]
        ours = quantize_activations(x, k_quant, path)
        theirs = _ggml_activations(ours, ggml.Q4_K if k_quant else ggml.Q8_0, cols)
        np.testing.assert_array_equal(theirs, ggml.quantize_activations(x, k_quant), err_msg=f"trial {trial}")
    zeros = quantize_activations(np.zeros(256, np.float32), k_quant, path)
    assert not zeros.any()


@pytest.mark.parametrize("kind", TYPES)
def test_dequantisation_is_llama_cpps(kind):
    rng = np.random.default_rng(kind + 11)
    cols = 2 * ggml.BLOCK[kind][0]
    data = weights(rng, 5, cols, kind)
    for row in data:
        np.testing.assert_array_equal(dequantize_row(kind, row, cols), ggml.dequantize(row, kind, cols))


def test_a_subset_of_rows_is_those_rows():
    rng = np.random.default_rng(5)
    data = weights(rng, 50, 512, ggml.Q6_K)
    full = PackedMatrix(pool(), ggml.Q6_K, data, 512)
    ids = [3, 4, 17, 49, 0]
    sub = PackedMatrix(pool(), ggml.Q6_K, data, 512, ids=ids)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    np.testing.assert_array_equal(sub.apply(x), full.apply(x)[:, ids])


def test_bad_input_is_refused():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="unsupported tensor type or shape"):
        PackedMatrix(pool(), ggml.Q4_K, weights(rng, 4, 256, ggml.Q4_K)[:, :100], 100)
    with pytest.raises(ValueError, match="row id out of range"):
        PackedMatrix(pool(), ggml.Q8_0, weights(rng, 4, 32, ggml.Q8_0), 32, ids=[5])
    with pytest.raises(ValueError, match="unknown kernel"):
        library.kernel_name("sse9")
