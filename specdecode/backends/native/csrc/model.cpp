#include "model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "reference.h"

namespace sd {

Model::~Model() {
    for (Layer& l : layers)
        for (Matrix* w : {l.wq, l.wk, l.wv, l.wo, l.gate, l.up, l.down}) matrix_free(w);
    matrix_free(output);
}

void seq_reserve(const Model& m, Seq& s, int64_t positions) {
    if (positions <= s.capacity) return;
    int64_t cap = std::max<int64_t>({positions, 2 * s.capacity, 64});
    cap = (cap + 15) / 16 * 16;
    const size_t per_layer = (size_t)(cap * m.kv_width());
    s.k.resize(m.layers.size());
    s.v.resize(m.layers.size());
    for (size_t l = 0; l < m.layers.size(); l++) {  // appending blocks keeps both layouts in place
        s.k[l].resize(per_layer);
        s.v[l].resize(per_layer);
    }
    s.capacity = cap;
}

namespace {

inline size_t k_index(int64_t t, int h, int d, int n_kv, int hd) {
    return ((size_t)(t / 16) * n_kv + h) * hd * 16 + (size_t)d * 16 + t % 16;
}

inline size_t v_index(int64_t t, int h, int d, int n_kv, int hd) { return ((size_t)t * n_kv + h) * hd + d; }

void copy_position(const Model& m, Seq& s, int64_t from, int64_t to) {
    const int n_kv = m.hp.n_kv, hd = m.head_dim();
    for (size_t l = 0; l < m.layers.size(); l++)
        for (int h = 0; h < n_kv; h++)
            for (int d = 0; d < hd; d++) {
                s.k[l][k_index(to, h, d, n_kv, hd)] = s.k[l][k_index(from, h, d, n_kv, hd)];
                s.v[l][v_index(to, h, d, n_kv, hd)] = s.v[l][v_index(from, h, d, n_kv, hd)];
            }
}

// Rows r0..r1 of a rows x n matrix, in parallel when there is enough work to share.
template <class Fn>
void par_rows(Pool& pool, int64_t rows, int64_t work_per_row, Fn&& fn) {
    if (rows * work_per_row < (1 << 16) || rows < 2) {
        fn(0, rows);
        return;
    }
    pool.run([&](int w, int n) {
        int64_t r0, r1;
        Pool::share(rows, w, n, &r0, &r1);
        if (r0 < r1) fn(r0, r1);
    });
}

// llama.cpp's rms_norm then mul: the sum of squares in double, y = (x * (1 / sqrt(mean + eps))) * w.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / n);
    const float scale = 1.0f / std::sqrt(mean + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

// llama.cpp's rope cache: theta_i = pos * base^(-2i/d), the powers as its running float product.
void rope_table(int64_t pos, int hd, float base, float* cos_out, float* sin_out) {
    const float theta_scale = std::pow(base, -2.0f / hd);
    float theta = (float)pos;
    for (int i = 0; i < hd / 2; i++) {
        cos_out[i] = std::cos(theta);
        sin_out[i] = std::sin(theta);
        theta *= theta_scale;
    }
}

void rope_neox(float* v, int hd, const float* c, const float* s) {
    for (int i = 0; i < hd / 2; i++) {
        const float x0 = v[i], x1 = v[i + hd / 2];
        v[i] = x0 * c[i] - x1 * s[i];
        v[i + hd / 2] = x0 * s[i] + x1 * c[i];
    }
}

template <class T>
T* grow(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

}  // namespace

void seq_keep(const Model& m, Seq& s, const int64_t* src, int n) {
    for (int i = 0; i < n; i++) {
        if (src[i] < s.length || src[i] >= s.capacity) throw std::invalid_argument("kept position out of range");
        if (src[i] != s.length + i) copy_position(m, s, src[i], s.length + i);
    }
    s.length += n;
}

size_t state_bytes(const Model& m, int64_t length) {
    const int64_t blocks = (length + 15) / 16;
    return m.layers.size() * (size_t)(blocks * 16 + length) * m.kv_width() * 2;
}

size_t seq_state_bytes(const Model& m, const Seq& s) { return state_bytes(m, s.length); }

void seq_state_get(const Model& m, const Seq& s, uint8_t* out) {
    const size_t kb = (size_t)((s.length + 15) / 16 * 16 * m.kv_width()) * 2, vb = (size_t)(s.length * m.kv_width()) * 2;
    for (size_t l = 0; l < m.layers.size(); l++) {
        if (kb) std::memcpy(out, s.k[l].data(), kb);
        out += kb;
        if (vb) std::memcpy(out, s.v[l].data(), vb);
        out += vb;
    }
}

void seq_state_set(const Model& m, Seq& s, const uint8_t* in, size_t nbytes, int64_t length) {
    // a copy from seq_state_get holds exactly state_bytes(length): anything else is not one
    if (length < 0 || nbytes != state_bytes(m, length)) throw std::invalid_argument("not a copy of a cache");
    seq_reserve(m, s, length);
    const size_t kb = (size_t)((length + 15) / 16 * 16 * m.kv_width()) * 2, vb = (size_t)(length * m.kv_width()) * 2;
    for (size_t l = 0; l < m.layers.size(); l++) {
        if (kb) std::memcpy(s.k[l].data(), in, kb);
        in += kb;
        if (vb) std::memcpy(s.v[l].data(), in, vb);
        in += vb;
    }
    s.length = length;
}

void forward(Model& m, Row* rows, int n_rows, float* logits) {
    const Hparams& hp = m.hp;
    const int E = hp.n_embd, hd = m.head_dim(), F = hp.n_ff, n_kv = hp.n_kv;
    const int64_t kvw = m.kv_width();
    Pool& pool = *m.pool;

    // the pass's tokens: position (RoPE), cache slot, row; a tree row's visibility bitmasks
    int64_t T = 0, S = 0;
    for (int r = 0; r < n_rows; r++) {
        const Row& row = rows[r];
        if (row.n < 1 || row.n_logits < 0 || row.n_logits > row.n) throw std::invalid_argument("bad row shape");
        for (int j = 0; j < row.n; j++)
            if (row.tokens[j] < 0 || row.tokens[j] >= hp.vocab) throw std::invalid_argument("token id out of range");
        for (int q = 0; q < r; q++)
            if (rows[q].seq == row.seq) throw std::invalid_argument("a pass holds each sequence at most once");
        T += row.n;
        S += row.n_logits;
    }
    std::vector<int64_t> pos(T), slot(T), start(n_rows);
    std::vector<std::vector<int32_t>> visible(n_rows);
    for (int r = 0, ti = 0; r < n_rows; r++) {
        const Row& row = rows[r];
        seq_reserve(m, *row.seq, row.seq->length + row.n);
        start[r] = ti;
        std::vector<int> depth(row.n, 0);
        if (row.parents) {
            const int words = (row.n + 31) / 32;
            visible[r].assign((size_t)row.n * words, 0);
            for (int j = 0; j < row.n; j++) {
                const int p = row.parents[j];
                if ((j == 0) != (p == -1) || p >= j) throw std::invalid_argument("a tree's parents must point back");
                int32_t* vj = visible[r].data() + (size_t)j * words;
                if (p >= 0) {
                    depth[j] = depth[p] + 1;
                    std::memcpy(vj, visible[r].data() + (size_t)p * words, words * 4);
                }
                vj[j / 32] |= (int32_t)(1u << (j % 32));
            }
        }
        for (int j = 0; j < row.n; j++, ti++) {
            pos[ti] = row.seq->length + (row.parents ? depth[j] : j);
            slot[ti] = row.seq->length + j;
        }
    }

    float* x = grow(m.x, T * E);
    float* h = grow(m.h, T * E);
    float* q = grow(m.q, T * E);
    float* kk = grow(m.kv_k, T * kvw);
    float* vv = grow(m.kv_v, T * kvw);
    float* att = grow(m.att, T * E);
    float* tmp = grow(m.tmp, T * E);
    float* fg = grow(m.ff_g, T * F);
    float* fu = grow(m.ff_u, T * F);
    std::vector<float> rope_c((size_t)T * hd / 2), rope_s((size_t)T * hd / 2);
    for (int64_t ti = 0; ti < T; ti++) rope_table(pos[ti], hd, hp.rope_base, &rope_c[ti * hd / 2], &rope_s[ti * hd / 2]);

    for (int r = 0, ti = 0; r < n_rows; r++)
        for (int j = 0; j < rows[r].n; j++, ti++)
            dequantize_row(m.embd_type, m.embd + (size_t)rows[r].tokens[j] * m.embd_row_bytes, E, x + ti * E);

    const float q_scale = 1.0f / std::sqrt((float)hd);
    const int group = hp.n_head / n_kv;
    if ((int)m.scratch.size() < pool.size()) m.scratch.resize(pool.size());
    Acts& acts = m.acts;
    const Kernels* gk = m.reference ? nullptr : m.kernels;

    for (size_t l = 0; l < m.layers.size(); l++) {
        const Layer& L = m.layers[l];
        par_rows(pool, T, E, [&](int64_t r0, int64_t r1) {
            for (int64_t t = r0; t < r1; t++) rms_norm(x + t * E, L.attn_norm.data(), h + t * E, E, hp.eps);
        });
        acts.reset(h, (int)T, E, E);
        GemmJob qkv[3] = {{L.wq, &acts, q, E}, {L.wk, &acts, kk, kvw}, {L.wv, &acts, vv, kvw}};
        gemm(pool, gk, qkv, 3);

        // bias, RoPE, scale; K and V into each row's cache at the token's slot
        for (int r = 0, ti = 0; r < n_rows; r++) {
            Seq& s = *rows[r].seq;
            for (int j = 0; j < rows[r].n; j++, ti++) {
                float* qt = q + ti * E;
                float* kt = kk + ti * kvw;
                float* vt = vv + ti * kvw;
                const float* c = &rope_c[ti * hd / 2];
                const float* sn = &rope_s[ti * hd / 2];
                for (int i = 0; i < E; i++) qt[i] += L.bq[i];
                for (int i = 0; i < kvw; i++) {
                    kt[i] += L.bk[i];
                    vt[i] += L.bv[i];
                }
                for (int hh = 0; hh < hp.n_head; hh++) {
                    rope_neox(qt + hh * hd, hd, c, sn);
                    for (int d = 0; d < hd; d++) qt[hh * hd + d] *= q_scale;
                }
                for (int hh = 0; hh < n_kv; hh++) {
                    rope_neox(kt + hh * hd, hd, c, sn);
                    for (int d = 0; d < hd; d++) {
                        s.k[l][k_index(slot[ti], hh, d, n_kv, hd)] = fp32_to_fp16(kt[hh * hd + d]);
                        s.v[l][v_index(slot[ti], hh, d, n_kv, hd)] = fp32_to_fp16(vt[hh * hd + d]);
                    }
                }
            }
        }

        // attention: one job per (row, KV head), dealt round robin
        const int jobs = n_rows * n_kv;
        auto attend_job = [&](int job, int worker) {
            const int r = job / n_kv, kh = job % n_kv;
            const Row& row = rows[r];
            AttnArgs a{};
            a.q = q + start[r] * E;
            a.out = att + start[r] * E;
            a.k = row.seq->k[l].data();
            a.v = row.seq->v[l].data();
            a.visible = row.parents ? visible[r].data() : nullptr;
            a.n_words = (row.n + 31) / 32;
            a.base = row.seq->length;
            a.n = row.n;
            a.kv_head = kh;
            a.group = group;
            a.n_head = hp.n_head;
            a.n_kv = n_kv;
            a.head_dim = hd;
            a.scratch = grow(m.scratch[worker], (size_t)group * (a.base + a.n + 16));
            m.kernels->attend(a);
        };
        // scratch is sized before the parallel region (vectors must not grow inside it)
        for (int w = 0; w < pool.size(); w++) {
            int64_t most = 0;
            for (int r = 0; r < n_rows; r++) most = std::max<int64_t>(most, rows[r].seq->length + rows[r].n);
            grow(m.scratch[w], (size_t)group * (most + 16));
        }
        pool.run([&](int w, int n) {
            for (int job = w; job < jobs; job += n) attend_job(job, w);
        });

        acts.reset(att, (int)T, E, E);
        GemmJob o{L.wo, &acts, tmp, E};
        gemm(pool, gk, &o, 1);
        for (int64_t i = 0; i < T * E; i++) x[i] += tmp[i];

        par_rows(pool, T, E, [&](int64_t r0, int64_t r1) {
            for (int64_t t = r0; t < r1; t++) rms_norm(x + t * E, L.ffn_norm.data(), h + t * E, E, hp.eps);
        });
        acts.reset(h, (int)T, E, E);
        GemmJob gu[2] = {{L.gate, &acts, fg, F}, {L.up, &acts, fu, F}};
        gemm(pool, gk, gu, 2);
        par_rows(pool, T, F, [&](int64_t r0, int64_t r1) { m.kernels->silu_mul(fg + r0 * F, fu + r0 * F, (r1 - r0) * F); });
        acts.reset(fg, (int)T, F, F);
        GemmJob dn{L.down, &acts, tmp, E};
        gemm(pool, gk, &dn, 1);
        for (int64_t i = 0; i < T * E; i++) x[i] += tmp[i];
    }

    // the output head, for the last n_logits tokens of each row
    if (S > 0) {
        float* hin = grow(m.head_in, S * E);
        for (int r = 0, si = 0; r < n_rows; r++)
            for (int i = rows[r].n - rows[r].n_logits; i < rows[r].n; i++, si++)
                rms_norm(x + (start[r] + i) * E, m.out_norm.data(), hin + si * E, E, hp.eps);
        acts.reset(hin, (int)S, E, E);
        const Matrix& w = *m.output;
        if (w.ids.empty()) {
            GemmJob head{&w, &acts, logits, hp.vocab};
            gemm(pool, gk, &head, 1);
        } else {  // a cut head: the kept tokens' logits, -inf elsewhere (probability 0 under q)
            float* sub = grow(m.head_out, S * w.rows());
            GemmJob head{&w, &acts, sub, w.rows()};
            gemm(pool, gk, &head, 1);
            for (int64_t si = 0; si < S; si++) {
                float* row = logits + si * hp.vocab;
                std::fill(row, row + hp.vocab, -INFINITY);
                for (int64_t i = 0; i < w.rows(); i++) row[w.ids[i]] = sub[si * w.rows() + i];
            }
        }
    }
    for (int r = 0; r < n_rows; r++) rows[r].seq->length += rows[r].parents ? 1 : rows[r].n;
}

}  // namespace sd
