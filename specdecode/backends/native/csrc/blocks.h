// GGUF's quantised block formats (as llama.cpp writes them) and our activation blocks.
//
// A weight matrix W has `rows` output features and `cols` inputs; each row is a run of blocks.
// The integer arithmetic of every dot product follows llama.cpp's, so the model we run is the
// GGUF's: K-quants (Q4_K, Q6_K) meet activations quantised per 256 (ActK, llama.cpp's Q8_K),
// 32-blocks (Q5_0, Q8_0) meet activations quantised per 32 (Act32, llama.cpp's Q8_0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace sd {

// ggml_type values of the GGUF tensor table.
enum GgmlType : int {
    T_F32 = 0,
    T_F16 = 1,
    T_Q5_0 = 6,
    T_Q8_0 = 8,
    T_Q4_K = 12,
    T_Q6_K = 14,
};

constexpr int QK_K = 256;  // weights per K-quant super-block
constexpr int QK32 = 32;   // weights per Q5_0 / Q8_0 block

struct BlockQ4K {  // w = d * sc_j * q - dmin * m_j, q in 0..15, 8 sub-blocks of 32
    uint16_t d, dmin;     // fp16
    uint8_t scales[12];   // 6-bit sc_j and m_j, packed
    uint8_t qs[128];      // 4-bit q: chunk c of 64 weights = 32 bytes, low nibbles sub-block 2c, high 2c+1
};
struct BlockQ6K {  // w = d * sc_j * (q - 32), q in 0..63, 16 sub-blocks of 16
    uint8_t ql[128];      // low 4 bits
    uint8_t qh[64];       // high 2 bits
    int8_t scales[16];
    uint16_t d;
};
struct BlockQ5_0 {  // w = d * (q - 16), q in 0..31
    uint16_t d;
    uint8_t qh[4];        // bit j: high bit of weight j
    uint8_t qs[16];       // low nibbles: weight j (low), weight j + 16 (high)
};
struct BlockQ8_0 {  // w = d * q, q in -128..127
    uint16_t d;
    int8_t qs[32];
};
static_assert(sizeof(BlockQ4K) == 144 && sizeof(BlockQ6K) == 210, "K-quant layouts");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ8_0) == 34, "32-block layouts");

// Activations quantised per 256 (llama.cpp's block_q8_K, extended with what our kernels need).
struct ActK {
    float d;              // x = d * q
    int8_t qs[QK_K];
    int16_t bsums[16];    // sums of q over each 16 (llama.cpp's)
    int16_t bsum32[8];    // sums over each 32 (Q4_K's mins term)
    int32_t neg32[16];    // -32 * bsums[j] (Q6_K's offset: (q6 - 32) . x = q6 . x - 32 * sum x)
};
// Activations quantised per 32 (llama.cpp's block_q8_0, d kept as the fp16 value it stores).
struct Act32 {
    float d;              // fp16-rounded, as llama.cpp multiplies it
    int8_t qs[QK32];
    int32_t neg16;        // -16 * sum q (Q5_0's offset)
    int32_t neg128;       // -128 * sum q (Q8_0 stored as q + 128)
};

inline bool is_k_quant(int type) { return type == T_Q4_K || type == T_Q6_K; }
inline bool supported_type(int type) {
    return type == T_Q4_K || type == T_Q6_K || type == T_Q5_0 || type == T_Q8_0;
}
inline int block_weights(int type) { return is_k_quant(type) ? QK_K : QK32; }
inline size_t block_bytes(int type) {
    switch (type) {
        case T_Q4_K: return sizeof(BlockQ4K);
        case T_Q6_K: return sizeof(BlockQ6K);
        case T_Q5_0: return sizeof(BlockQ5_0);
        case T_Q8_0: return sizeof(BlockQ8_0);
        case T_F32: return 4;
        case T_F16: return 2;
    }
    return 0;
}

// IEEE half <-> float, exactly (no F16C needed: used at load and in the reference path).
inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t fp32_to_fp16(float f) {  // round to nearest even, as F16C's vcvtps2ph
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        int shift = 14 - exp;
        uint32_t half = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = (uint32_t)(exp << 10) | (mant >> 13), rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;  // may carry into the exponent: correct
    return (uint16_t)(sign | half);
}

// Q4_K's packed 6-bit scale and min of sub-block j (llama.cpp's get_scale_min_k4).
inline void q4k_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q6_K's q (0..63) of weight l (0..255) of a block.
inline int q6k_value(const BlockQ6K& b, int l) {
    int half = l / 128, r = l % 128, quarter = r / 32, i = r % 32;
    const uint8_t* ql = b.ql + 64 * half;
    const uint8_t* qh = b.qh + 32 * half;
    int low = quarter & 1 ? ql[i + 32] : ql[i];
    low = quarter & 2 ? low >> 4 : low & 0xF;
    return low | (((qh[i] >> (2 * quarter)) & 3) << 4);
}
inline int q6k_scale_index(int l) { return l / 16; }  // sub-block of 16

inline int q4k_value(const BlockQ4K& b, int l) {  // 0..15
    int chunk = l / 64, r = l % 64;
    uint8_t byte = b.qs[32 * chunk + (r % 32)];
    return r < 32 ? byte & 0xF : byte >> 4;
}
inline int q5_0_value(const BlockQ5_0& b, int l) {  // 0..31
    uint32_t qh;
    std::memcpy(&qh, b.qh, 4);
    int low = l < 16 ? b.qs[l] & 0xF : b.qs[l - 16] >> 4;
    return low | (((qh >> l) & 1) << 4);
}

}  // namespace sd
