#include "matmul.h"

#include <stdexcept>

#include "reference.h"

namespace sd {

Matrix* matrix_new(Pool& pool, int type, int64_t rows, int64_t cols, const void* gguf, const int32_t* ids,
                   int64_t n_ids) {
    auto* m = new Matrix();
    try {
        m->packed = pack_alloc(type, ids ? n_ids : rows, cols);
    } catch (...) {
        delete m;
        throw;
    }
    m->gguf = (const uint8_t*)gguf;
    m->row_bytes = (size_t)(cols / block_weights(type)) * block_bytes(type);
    if (ids) m->ids.assign(ids, ids + n_ids);
    const int32_t* sel = ids ? m->ids.data() : nullptr;
    pool.run([&](int w, int n) {
        int64_t t0, t1;
        Pool::share(m->packed.row_tiles, w, n, &t0, &t1);
        pack_range(m->packed, gguf, sel, t0, t1);
    });
    return m;
}

void matrix_free(Matrix* m) {
    if (!m) return;
    pack_free(m->packed);
    delete m;
}

void Acts::need(Pool& pool, const Kernels* kernels, int type) {
    const bool k_quant = is_k_quant(type);
    if (k_quant ? have_k : have_32) return;
    const int64_t per_row = cols / (k_quant ? QK_K : QK32);
    if (k_quant) k.resize((size_t)(n * per_row));
    else q32.resize((size_t)(n * per_row));
    pool.run([&](int w, int workers) {
        int64_t r0, r1;
        Pool::share(n, w, workers, &r0, &r1);
        for (int64_t r = r0; r < r1; r++) {
            if (k_quant) (kernels ? kernels->quantize_k : quantize_act_k)(x + r * ld, cols, k.data() + r * per_row);
            else (kernels ? kernels->quantize_32 : quantize_act_32)(x + r * ld, cols, q32.data() + r * per_row);
        }
    });
    (k_quant ? have_k : have_32) = true;
}

namespace {

void run_reference(const GemmJob& j, int64_t t0, int64_t t1) {
    const Matrix& w = *j.w;
    const int64_t per_row = w.cols() / block_weights(w.type());
    for (int64_t i = t0 * TILE; i < t1 * TILE && i < w.rows(); i++)
        for (int r = 0; r < j.x->n; r++) {
            const ActK* xk = j.x->have_k ? j.x->k.data() + r * per_row : nullptr;
            const Act32* x32 = j.x->have_32 ? j.x->q32.data() + r * per_row : nullptr;
            j.y[r * j.ldy + i] = reference_dot(w.type(), w.gguf_row(i), w.cols(), xk, x32);
        }
}

}  // namespace

void gemm(Pool& pool, const Kernels* kernels, GemmJob* jobs, int n_jobs) {
    size_t total = 0;
    for (int i = 0; i < n_jobs; i++) {
        const Matrix& w = *jobs[i].w;
        if (jobs[i].x->cols != w.cols()) throw std::invalid_argument("activation width differs from the matrix's inputs");
        jobs[i].x->need(pool, kernels, w.type());
        total += w.packed.bytes;
    }
    pool.run([&](int worker, int workers) {
        // this worker's byte range of all jobs' tiles, laid end to end; a tile belongs to the
        // worker whose range holds its first byte
        const size_t lo = total * worker / workers, hi = total * (worker + 1) / workers;
        size_t offset = 0;
        for (int i = 0; i < n_jobs; i++) {
            const GemmJob& j = jobs[i];
            const Packed& p = j.w->packed;
            const size_t per_tile = p.bytes / p.row_tiles;
            const size_t start = offset, end = offset + p.bytes;
            offset = end;
            if (hi <= start || lo >= end) continue;
            auto first = [&](size_t b) { return (int64_t)((b - start + per_tile - 1) / per_tile); };
            const int64_t t0 = lo <= start ? 0 : first(lo), t1 = hi >= end ? p.row_tiles : first(hi);
            if (t0 >= t1) continue;
            if (!kernels) {
                run_reference(j, t0, t1);
            } else if (is_k_quant(p.type)) {
                kernels->gemm_k(p, t0, t1, j.x->k.data(), p.blocks, j.x->n, j.y, j.ldy);
            } else {
                kernels->gemm_32(p, t0, t1, j.x->q32.data(), p.blocks, j.x->n, j.y, j.ldy);
            }
        }
    });
}

}  // namespace sd
