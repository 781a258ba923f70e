// The plain reference: activation quantisation exactly as llama.cpp does it, dequantisation of
// GGUF rows, and a dot product straight from the GGUF blocks, with the fast kernels' order of
// float operations. The kernels must reproduce it bit for bit (tests/backends/test_native_kernels.py).
#pragma once

#include "blocks.h"

namespace sd {

// llama.cpp's quantize_row_q8_K_ref (the scale from the element of largest magnitude, first
// occurrence; q = round-half-even(-127 / max * x), at most 127), plus our kernels' block sums.
void quantize_act_k(const float* x, int64_t cols, ActK* out);
// llama.cpp's x86 quantize_row_q8_0 (d = max|x| / 127 stored as fp16, q = round-half-even(x * 127 / max)).
void quantize_act_32(const float* x, int64_t cols, Act32* out);

// One GGUF row of `cols` weights of `type` as floats (llama.cpp's dequantize_row_*).
void dequantize_row(int type, const void* row, int64_t cols, float* out);

// sum over blocks of the dot product of one GGUF row with one quantised activation row, in the
// kernels' order: acc = fma(d_w * d_x, sumi, acc) (Q4_K then acc = fma(-(dmin_w * d_x), summ, acc)).
float reference_dot(int type, const void* row, int64_t cols, const ActK* xk, const Act32* x32);

}  // namespace sd
