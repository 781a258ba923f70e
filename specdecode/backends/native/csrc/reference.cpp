#include "reference.h"

#include <cmath>

namespace sd {

namespace {

// Round half to even, as llama.cpp's nearest_int (the 1.5 * 2^23 trick) and _mm256_round_ps do.
inline int round_even(float v) { return (int)std::nearbyint(v); }

}  // namespace

void quantize_act_k(const float* x, int64_t cols, ActK* out) {
    for (int64_t b = 0; b < cols / QK_K; b++, x += QK_K) {
        ActK& a = out[b];
        float max = 0, amax = 0;
        for (int j = 0; j < QK_K; j++) {
            float ax = std::fabs(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (amax == 0) {
            std::memset(&a, 0, sizeof(a));
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < QK_K; j++) {
            int v = round_even(iscale * x[j]);
            a.qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += a.qs[16 * j + i];
            a.bsums[j] = (int16_t)sum;
            a.neg32[j] = -32 * sum;
        }
        for (int j = 0; j < 8; j++) a.bsum32[j] = (int16_t)(a.bsums[2 * j] + a.bsums[2 * j + 1]);
        a.d = 1 / iscale;
    }
}

void quantize_act_32(const float* x, int64_t cols, Act32* out) {
    for (int64_t b = 0; b < cols / QK32; b++, x += QK32) {
        Act32& a = out[b];
        float amax = 0;
        for (int j = 0; j < QK32; j++) amax = std::fmax(amax, std::fabs(x[j]));
        const float d = amax / 127.f;
        a.d = fp16_to_fp32(fp32_to_fp16(d));
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK32; j++) {
            int v = round_even(x[j] * id);
            v = v > 127 ? 127 : v < -128 ? -128 : v;
            a.qs[j] = (int8_t)v;
            sum += v;
        }
        a.neg16 = -16 * sum;
        a.neg128 = -128 * sum;
    }
}

void dequantize_row(int type, const void* row, int64_t cols, float* out) {
    const int64_t nb = cols / block_weights(type);
    if (type == T_Q4_K) {
        const BlockQ4K* b = (const BlockQ4K*)row;
        for (int64_t i = 0; i < nb; i++) {
            const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
            for (int j = 0; j < 8; j++) {
                uint8_t sc, m;
                q4k_scale_min(j, b[i].scales, &sc, &m);
                const float d1 = d * sc, m1 = dmin * m;
                for (int l = 0; l < 32; l++) out[QK_K * i + 32 * j + l] = d1 * q4k_value(b[i], 32 * j + l) - m1;
            }
        }
    } else if (type == T_Q6_K) {
        const BlockQ6K* b = (const BlockQ6K*)row;
        for (int64_t i = 0; i < nb; i++) {
            const float d = fp16_to_fp32(b[i].d);
            for (int l = 0; l < QK_K; l++)
                out[QK_K * i + l] = d * b[i].scales[q6k_scale_index(l)] * (int8_t)(q6k_value(b[i], l) - 32);
        }
    } else if (type == T_Q5_0) {
        const BlockQ5_0* b = (const BlockQ5_0*)row;
        for (int64_t i = 0; i < nb; i++) {
            const float d = fp16_to_fp32(b[i].d);
            for (int l = 0; l < QK32; l++) out[QK32 * i + l] = (q5_0_value(b[i], l) - 16) * d;
        }
    } else if (type == T_Q8_0) {
        const BlockQ8_0* b = (const BlockQ8_0*)row;
        for (int64_t i = 0; i < nb; i++) {
            const float d = fp16_to_fp32(b[i].d);
            for (int l = 0; l < QK32; l++) out[QK32 * i + l] = b[i].qs[l] * d;
        }
    } else if (type == T_F32) {
        std::memcpy(out, row, cols * 4);
    } else if (type == T_F16) {
        const uint16_t* h = (const uint16_t*)row;
        for (int64_t l = 0; l < cols; l++) out[l] = fp16_to_fp32(h[l]);
    }
}

float reference_dot(int type, const void* row, int64_t cols, const ActK* xk, const Act32* x32) {
    float acc = 0;
    const int64_t nb = cols / block_weights(type);
    for (int64_t i = 0; i < nb; i++) {
        if (type == T_Q4_K) {
            const BlockQ4K& b = ((const BlockQ4K*)row)[i];
            int32_t sumi = 0, summ = 0;
            for (int j = 0; j < 8; j++) {
                uint8_t sc, m;
                q4k_scale_min(j, b.scales, &sc, &m);
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += q4k_value(b, 32 * j + l) * xk[i].qs[32 * j + l];
                sumi += sc * dot;
                summ += m * xk[i].bsum32[j];
            }
            const float dw = fp16_to_fp32(b.d), dmin = fp16_to_fp32(b.dmin);
            acc = std::fma(dw * xk[i].d, (float)sumi, acc);
            acc = std::fma(-(dmin * xk[i].d), (float)summ, acc);
        } else if (type == T_Q6_K) {
            const BlockQ6K& b = ((const BlockQ6K*)row)[i];
            int32_t sumi = 0;
            for (int j = 0; j < 16; j++) {
                int32_t dot = 0;
                for (int l = 0; l < 16; l++) dot += (q6k_value(b, 16 * j + l) - 32) * xk[i].qs[16 * j + l];
                sumi += b.scales[j] * dot;
            }
            acc = std::fma(fp16_to_fp32(b.d) * xk[i].d, (float)sumi, acc);
        } else if (type == T_Q5_0) {
            const BlockQ5_0& b = ((const BlockQ5_0*)row)[i];
            int32_t sumi = 0;
            for (int l = 0; l < QK32; l++) sumi += (q5_0_value(b, l) - 16) * x32[i].qs[l];
            acc = std::fma(fp16_to_fp32(b.d) * x32[i].d, (float)sumi, acc);
        } else if (type == T_Q8_0) {
            const BlockQ8_0& b = ((const BlockQ8_0*)row)[i];
            int32_t sumi = 0;
            for (int l = 0; l < QK32; l++) sumi += b.qs[l] * x32[i].qs[l];
            acc = std::fma(fp16_to_fp32(b.d) * x32[i].d, (float)sumi, acc);
        }
    }
    return acc;
}

}  // namespace sd
