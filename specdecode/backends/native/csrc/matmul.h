// Matrices and the parallel GEMM over them: activations quantised once per pass (in the format
// each weight type multiplies), every job's row tiles shared among the pool's workers in
// contiguous runs of about equal bytes, so each core streams its own part of the weights once.
#pragma once

#include <vector>

#include "kernels.h"
#include "pool.h"
#include "repack.h"

namespace sd {

struct Matrix {
    Packed packed;                  // the kernels' tiles
    const uint8_t* gguf = nullptr;  // the GGUF rows (mapped by the caller): the reference path reads them
    size_t row_bytes = 0;
    std::vector<int32_t> ids;       // packed row i is GGUF row ids[i] (empty: all rows, in order)

    int type() const { return packed.type; }
    int64_t rows() const { return packed.rows; }
    int64_t cols() const { return packed.cols; }
    const uint8_t* gguf_row(int64_t i) const { return gguf + (ids.empty() ? i : ids[i]) * row_bytes; }
};

// Repacks in parallel; ids (n_ids of them) selects GGUF rows, null for all.
Matrix* matrix_new(Pool& pool, int type, int64_t rows, int64_t cols, const void* gguf, const int32_t* ids, int64_t n_ids);
void matrix_free(Matrix* m);

// n rows of `cols` activations, quantised on demand in each format.
struct Acts {
    const float* x = nullptr;
    int64_t cols = 0, ld = 0;
    int n = 0;
    std::vector<ActK> k;
    std::vector<Act32> q32;
    bool have_k = false, have_32 = false;

    void reset(const float* rows, int n_rows, int64_t n_cols, int64_t stride) {
        x = rows; n = n_rows; cols = n_cols; ld = stride; have_k = have_32 = false;
    }
    // quantise for `type`'s kernels, in parallel over rows (kernels null: the reference's scalar code)
    void need(Pool& pool, const Kernels* kernels, int type);
};

struct GemmJob {
    const Matrix* w;
    Acts* x;
    float* y;     // [x->n][ldy]: y[r][i] = row i of w . x_r
    int64_t ldy;
};

// All jobs in one parallel region; kernels == nullptr runs the reference (reference_dot per output).
void gemm(Pool& pool, const Kernels* kernels, GemmJob* jobs, int n_jobs);

}  // namespace sd
