// What one instruction set provides: the tile GEMMs and the float work of a pass. One table per
// path (isa_avx512.cpp: AVX-512 VNNI; isa_avx2.cpp: AVX-VNNI and plain AVX2), chosen at run time
// from the CPU's flags (cpu.cpp); the reference (reference.h) is the oracle they are tested against.
#pragma once

#include "tiles.h"

namespace sd {

// One sequence row's attention for one KV head: queries of `n` tokens x `group` heads against the
// cache (K in blocks of 16 positions, [block][kv head][128][16] fp16; V [position][kv head][128] fp16).
struct AttnArgs {
    const float* q;            // q of the row's first token, [n][n_head][head_dim], RoPE applied, scaled
    float* out;                // [n][n_head][head_dim]
    const uint16_t* k;         // this layer's K cache of the row's sequence
    const uint16_t* v;
    const int32_t* visible;    // tree rows: per token, a bitmask word array (n_words each) of visible pass tokens; null: causal
    int n_words;
    int64_t base;              // cache positions before the pass (all visible)
    int n;                     // tokens of the row in this pass (their K/V are at base .. base+n-1)
    int kv_head, group, n_head, n_kv, head_dim;
    float* scratch;            // at least group * (base + n + 16) floats
};

struct Kernels {
    const char* name;
    // y[r * ldy + 16 t + c] = row 16t+c of p . x_r, for row tiles t0 <= t < t1 and activation rows r < n
    // (x_r = x + r * x_stride blocks); the last tile writes only p.rows - 16t outputs.
    void (*gemm_k)(const Packed& p, int64_t t0, int64_t t1, const ActK* x, int64_t x_stride, int n, float* y,
                   int64_t ldy);
    void (*gemm_32)(const Packed& p, int64_t t0, int64_t t1, const Act32* x, int64_t x_stride, int n, float* y,
                    int64_t ldy);
    void (*attend)(const AttnArgs& a);
    // reference.h's quantize_act_k / quantize_act_32, bit for bit
    void (*quantize_k)(const float* x, int64_t cols, ActK* out);
    void (*quantize_32)(const float* x, int64_t cols, Act32* out);
    void (*silu_mul)(float* g, const float* u, int64_t n);  // g = silu(g) * u
};

extern const Kernels kernels_avx512_vnni;
extern const Kernels kernels_avx_vnni;
extern const Kernels kernels_avx2;

}  // namespace sd
