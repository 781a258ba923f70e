"""A tiny Qwen2 GGUF built in-process (random weights quantised by llama.cpp, in the mix of types the
embedded pair holds), and a plain numpy forward pass of it: the oracle for the native forward pass.

The oracle quantises each activation row as llama.cpp does (its own functions), dequantises it and
multiplies in float64, rounds K and V to fp16 as the cache holds them, and does the rest (RMSNorm,
NEOX RoPE, grouped-query attention, SwiGLU) in float64: what differs from the native pass is float32
rounding only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.backends.native import ggml

N_EMBD, N_HEAD, N_KV, N_FF, VOCAB, N_LAYER, EPS, ROPE_BASE = 256, 4, 2, 512, 300, 2, 1e-6, 10000.0
HEAD_DIM = N_EMBD // N_HEAD
# (type, rows, cols) per matrix; layer 1 varies the types as the embedded pair does
MATRICES = {
    "attn_q": [(ggml.Q4_K, N_EMBD, N_EMBD), (ggml.Q5_0, N_EMBD, N_EMBD)],
    "attn_k": [(ggml.Q4_K, N_KV * HEAD_DIM, N_EMBD), (ggml.Q5_0, N_KV * HEAD_DIM, N_EMBD)],
    "attn_v": [(ggml.Q6_K, N_KV * HEAD_DIM, N_EMBD), (ggml.Q8_0, N_KV * HEAD_DIM, N_EMBD)],
    "attn_output": [(ggml.Q4_K, N_EMBD, N_EMBD), (ggml.Q5_0, N_EMBD, N_EMBD)],
    "ffn_gate": [(ggml.Q4_K, N_FF, N_EMBD), (ggml.Q5_0, N_FF, N_EMBD)],
    "ffn_up": [(ggml.Q4_K, N_FF, N_EMBD), (ggml.Q5_0, N_FF, N_EMBD)],
    "ffn_down": [(ggml.Q6_K, N_EMBD, N_FF), (ggml.Q4_K, N_EMBD, N_FF)],
}


@dataclass
class Tiny:
    path: Path
    quants: dict   # name -> (type, GGUF rows uint8 [rows, bytes])
    floats: dict   # name -> float32 vector
    tied: bool

    def dequantized(self, name: str) -> np.ndarray:
        kind, data = self.quants[name]
        cols = data.shape[1] // ggml.BLOCK[kind][1] * ggml.BLOCK[kind][0]
        return np.stack([ggml.dequantize(row, kind, cols) for row in data]).astype(np.float64)


def build(path: Path, seed: int = 0, tied: bool = False, architecture: str = "qwen2") -> Tiny:
    import gguf

    rng = np.random.default_rng(seed)
    quants, floats = {}, {}
    quants["token_embd.weight"] = (ggml.Q4_K, ggml.quantize(rng.standard_normal((VOCAB, N_EMBD)).astype(np.float32),
                                                            ggml.Q4_K))
    if not tied:
        quants["output.weight"] = (ggml.Q6_K, ggml.quantize(
            rng.standard_normal((VOCAB, N_EMBD)).astype(np.float32) * 0.5, ggml.Q6_K))
    floats["output_norm.weight"] = (1 + 0.1 * rng.standard_normal(N_EMBD)).astype(np.float32)
    for layer in range(N_LAYER):
        for name, shapes in MATRICES.items():
            kind, rows, cols = shapes[layer]
            w = rng.standard_normal((rows, cols)).astype(np.float32) / np.sqrt(cols)
            quants[f"blk.{layer}.{name}.weight"] = (kind, ggml.quantize(w, kind))
        for name, size in (("attn_norm.weight", N_EMBD), ("ffn_norm.weight", N_EMBD)):
            floats[f"blk.{layer}.{name}"] = (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)
        for name, size in (("attn_q.bias", N_EMBD), ("attn_k.bias", N_KV * HEAD_DIM), ("attn_v.bias", N_KV * HEAD_DIM)):
            floats[f"blk.{layer}.{name}"] = (0.1 * rng.standard_normal(size)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(N_LAYER)
    writer.add_context_length(512)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_KV)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_layer_norm_rms_eps(EPS)
    for name, (kind, data) in quants.items():
        cols = data.shape[1] // ggml.BLOCK[kind][1] * ggml.BLOCK[kind][0]
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType(kind))
    for name, vec in floats.items():
        writer.add_tensor(name, vec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tiny(path, quants, floats, tied)


def _matmul(tiny: Tiny, name: str, h: np.ndarray) -> np.ndarray:
    """h [n, cols] times the matrix, each row of h quantised first exactly as llama.cpp does."""
    kind = tiny.quants[name][0]
    k_quant = kind in (ggml.Q4_K, ggml.Q6_K)
    per, size = (256, ggml.Q8K_BYTES) if k_quant else (32, ggml.Q8_0_BYTES)
    rows = []
    for row in h.astype(np.float32):
        blocks = ggml.quantize_activations(row, k_quant).reshape(-1, size)
        if k_quant:
            d = blocks[:, 0:4].copy().view(np.float32).astype(np.float64)
            q = blocks[:, 4:4 + per].view(np.int8).astype(np.float64)
        else:
            d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
            q = blocks[:, 2:2 + per].view(np.int8).astype(np.float64)
        rows.append((d * q).ravel())
    return np.stack(rows) @ tiny.dequantized(name).T


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _rope(v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """NEOX rotation of [n, heads, head_dim] by each row's position."""
    half = HEAD_DIM // 2
    theta = positions[:, None] * ROPE_BASE ** (-2.0 * np.arange(half) / HEAD_DIM)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = v[..., :half], v[..., half:]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)


def forward(tiny: Tiny, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] of a sequence from an empty cache."""
    n = len(tokens)
    x = tiny.dequantized("token_embd.weight")[tokens]
    pos = np.arange(n, dtype=np.float64)
    for layer in range(N_LAYER):
        f = lambda name: tiny.floats[f"blk.{layer}.{name}"].astype(np.float64)  # noqa: E731
        h = _rms(x, f("attn_norm.weight"))
        q = (_matmul(tiny, f"blk.{layer}.attn_q.weight", h) + f("attn_q.bias")).reshape(n, N_HEAD, HEAD_DIM)
        k = (_matmul(tiny, f"blk.{layer}.attn_k.weight", h) + f("attn_k.bias")).reshape(n, N_KV, HEAD_DIM)
        v = (_matmul(tiny, f"blk.{layer}.attn_v.weight", h) + f("attn_v.bias")).reshape(n, N_KV, HEAD_DIM)
        q, k = _rope(q, pos), _rope(k, pos)
        k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)  # the cache's fp16
        out = np.zeros((n, N_HEAD, HEAD_DIM))
        for head in range(N_HEAD):
            kv = head // (N_HEAD // N_KV)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(HEAD_DIM)
            scores[np.triu_indices(n, 1)] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + _matmul(tiny, f"blk.{layer}.attn_output.weight", out.reshape(n, N_EMBD))
        h = _rms(x, f("ffn_norm.weight"))
        g, u = _matmul(tiny, f"blk.{layer}.ffn_gate.weight", h), _matmul(tiny, f"blk.{layer}.ffn_up.weight", h)
        x = x + _matmul(tiny, f"blk.{layer}.ffn_down.weight", g / (1 + np.exp(-g)) * u)
    h = _rms(x, tiny.floats["output_norm.weight"].astype(np.float64))
    return _matmul(tiny, "token_embd.weight" if tiny.tied else "output.weight", h)
