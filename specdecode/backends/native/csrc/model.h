// The Qwen2 forward pass (both models of the embedded pair; any GGUF of the qwen2 architecture
// whose tensors the kernels take): RMSNorm, Q/K/V with bias, RoPE (NEOX), grouped-query attention
// over per-sequence caches, SwiGLU, the output head for the positions asked for. One call runs
// the rows of several sequences in one pass: their tokens go through every matrix together.
#pragma once

#include <vector>

#include "matmul.h"

namespace sd {

struct Hparams {
    int n_layer, n_embd, n_head, n_kv, n_ff;
    int64_t vocab;
    float eps, rope_base;
};

struct Layer {
    std::vector<float> attn_norm, ffn_norm, bq, bk, bv;
    Matrix *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    Matrix *gate = nullptr, *up = nullptr, *down = nullptr;
};

// One sequence's cache: K in blocks of 16 positions ([block][kv head][head_dim][16], fp16: the
// attention kernel reads 16 positions per load), V by position ([pos][kv head][head_dim], fp16).
// Rolling back is setting `length`; positions beyond it are overwritten by later passes.
struct Seq {
    int64_t length = 0, capacity = 0;
    std::vector<std::vector<uint16_t>> k, v;  // per layer
};

struct Row {
    Seq* seq;
    const int32_t* tokens;
    int n;
    const int32_t* parents;  // a tree: parents[j] < j, parents[0] = -1 (null: a chain)
    int n_logits;            // logits for the last n_logits tokens (a tree: n)
};

struct Model {
    Hparams hp{};
    std::vector<Layer> layers;
    int embd_type = 0;
    const uint8_t* embd = nullptr;  // token_embd rows (GGUF), dequantised per token
    size_t embd_row_bytes = 0;
    std::vector<float> out_norm;
    Matrix* output = nullptr;      // may hold a subset of the vocabulary (output->ids): the rest is -inf
    Pool* pool = nullptr;
    const Kernels* kernels = nullptr;  // the float work (attention, SwiGLU) and, unless `reference`, the GEMMs
    bool reference = false;            // GEMMs by reference_dot, from the GGUF rows (tests)

    // per-pass buffers, grown as needed
    std::vector<float> x, h, q, kv_k, kv_v, att, tmp, ff_g, ff_u, head_in, head_out;
    std::vector<std::vector<float>> scratch;  // per worker (attention scores)
    Acts acts;

    ~Model();
    int head_dim() const { return hp.n_embd / hp.n_head; }
    int64_t kv_width() const { return (int64_t)hp.n_kv * head_dim(); }
};

void seq_reserve(const Model& m, Seq& s, int64_t positions);
// Moves the cache entries of positions src[i] to length + i (a tree's accepted path), then
// length += n.
void seq_keep(const Model& m, Seq& s, const int64_t* src, int n);
size_t seq_state_bytes(const Model& m, const Seq& s);
void seq_state_get(const Model& m, const Seq& s, uint8_t* out);
void seq_state_set(const Model& m, Seq& s, const uint8_t* in, size_t nbytes, int64_t length);

// logits: [sum of rows' n_logits][vocab], rows in order.
void forward(Model& m, Row* rows, int n_rows, float* logits);

}  // namespace sd
