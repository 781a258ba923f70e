// The C interface the Python side (backends/native/library.py) calls through ctypes. Every
// function returns 0 (or a handle) on success; on failure -1 (or null) and sd_last_error() says why.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "model.h"
#include "reference.h"

using namespace sd;

namespace {

thread_local std::string last_error;

template <class Fn>
int guard(Fn&& fn) {
    try {
        fn();
        return 0;
    } catch (const std::bad_alloc&) {
        last_error = "out of memory";
    } catch (const std::exception& e) {
        last_error = e.what();
    }
    return -1;
}

template <class T, class Fn>
T* guard_ptr(Fn&& fn) {
    T* out = nullptr;
    if (guard([&] { out = fn(); }) != 0) return nullptr;
    return out;
}

int cpu_flags() {
    int flags = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        flags |= 1;
        if (__builtin_cpu_supports("avxvnni")) flags |= 2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
            __builtin_cpu_supports("avx512vnni"))
            flags |= 4;
    }
#endif
    return flags;
}

// A kernel table by name ("auto": the best this CPU runs); null if the CPU cannot run it.
const Kernels* kernels_by_name(const char* name, bool* reference) {
    const int flags = cpu_flags();
    *reference = std::strcmp(name, "reference") == 0;
    const bool automatic = *reference || std::strcmp(name, "auto") == 0;
    if ((flags & 4) && (automatic || !std::strcmp(name, "avx512-vnni"))) return &kernels_avx512_vnni;
    if ((flags & 2) && (automatic || !std::strcmp(name, "avx-vnni"))) return &kernels_avx_vnni;
    if ((flags & 1) && (automatic || !std::strcmp(name, "avx2"))) return &kernels_avx2;
    last_error = std::string("this CPU cannot run the ") + name + " kernels";
    return nullptr;
}

}  // namespace

#pragma GCC visibility push(default)  // the library is built with hidden visibility: export only these
extern "C" {

const char* sd_last_error(void) { return last_error.c_str(); }
int sd_cpu_flags(void) { return cpu_flags(); }
int sd_act_k_bytes(void) { return (int)sizeof(ActK); }
int sd_act_32_bytes(void) { return (int)sizeof(Act32); }

const char* sd_kernel_name(const char* name) {
    bool reference;
    const Kernels* k = kernels_by_name(name, &reference);
    return k ? (reference ? "reference" : k->name) : nullptr;
}

void* sd_pool_new(int threads) { return guard_ptr<Pool>([&] { return new Pool(threads); }); }
void sd_pool_free(void* pool) { delete (Pool*)pool; }

void* sd_matrix_new(void* pool, int type, int64_t rows, int64_t cols, const void* gguf, const int32_t* ids,
                    int64_t n_ids) {
    return guard_ptr<Matrix>([&] {
        if (ids)
            for (int64_t i = 0; i < n_ids; i++)
                if (ids[i] < 0 || ids[i] >= rows) throw std::invalid_argument("row id out of range");
        return matrix_new(*(Pool*)pool, type, rows, cols, gguf, ids, n_ids);
    });
}
void sd_matrix_free(void* m) { matrix_free((Matrix*)m); }
int64_t sd_matrix_bytes(void* m) { return (int64_t)((Matrix*)m)->packed.bytes; }
int sd_packable(int type, int64_t cols) { return packable(type, cols) ? 1 : 0; }

// y[r][i] = row i of the matrix . x_r, x quantised as the matrix's type needs (x: n rows of cols floats).
int sd_matmul(void* pool, const char* kernel, void* matrix, const float* x, int n, float* y) {
    return guard([&] {
        bool reference;
        const Kernels* k = kernels_by_name(kernel, &reference);
        if (!k) throw std::invalid_argument(last_error);
        Matrix* w = (Matrix*)matrix;
        Acts acts;
        acts.reset(x, n, w->cols(), w->cols());
        GemmJob job{w, &acts, y, w->rows()};
        gemm(*(Pool*)pool, reference ? nullptr : k, &job, 1);
    });
}

// sd_matmul with the activations given already quantised (n rows of ActK or Act32 blocks, as the
// matrix's type takes): the tests set them to exact integers to check every kernel's integer part.
int sd_matmul_quantized(void* pool, const char* kernel, void* matrix, const void* acts, int n, float* y) {
    return guard([&] {
        bool reference;
        const Kernels* k = kernels_by_name(kernel, &reference);
        if (!k) throw std::invalid_argument(last_error);
        Matrix* w = (Matrix*)matrix;
        const int64_t per_row = w->cols() / block_weights(w->type());
        Acts a;
        a.reset(nullptr, n, w->cols(), w->cols());
        if (is_k_quant(w->type())) {
            a.k.assign((const ActK*)acts, (const ActK*)acts + n * per_row);
            a.have_k = true;
        } else {
            a.q32.assign((const Act32*)acts, (const Act32*)acts + n * per_row);
            a.have_32 = true;
        }
        GemmJob job{w, &a, y, w->rows()};
        gemm(*(Pool*)pool, reference ? nullptr : k, &job, 1);
    });
}

// Seconds per matmul (median of `reps` sweeps over the matrices in turn, each sweep timed as a
// whole and divided by their number): what benchmarks/frontier.py reports per projection, with no
// Python between the calls. x: n rows; y: room for n x the largest matrix's rows.
double sd_time_matmul(void* pool, const char* kernel, void** matrices, int count, const float* x, int n, float* y,
                      int reps) {
    double out = -1;
    guard([&] {
        bool reference;
        const Kernels* k = kernels_by_name(kernel, &reference);
        if (!k) throw std::invalid_argument(last_error);
        std::vector<double> sweeps;
        Acts acts;
        for (int rep = 0; rep < reps + 1; rep++) {  // the first sweep warms up
            auto t0 = std::chrono::steady_clock::now();
            for (int i = 0; i < count; i++) {
                Matrix* w = (Matrix*)matrices[i];
                acts.reset(x, n, w->cols(), w->cols());
                GemmJob job{w, &acts, y, w->rows()};
                gemm(*(Pool*)pool, reference ? nullptr : k, &job, 1);
            }
            std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
            if (rep) sweeps.push_back(dt.count() / count);
        }
        std::sort(sweeps.begin(), sweeps.end());
        out = sweeps[sweeps.size() / 2];
    });
    return out;
}

// Activations quantised as `kernel`'s path does it (format 0: per 256, ActK; 1: per 32, Act32).
int sd_quantize(const char* kernel, int format, const float* x, int64_t cols, void* out) {
    return guard([&] {
        bool reference;
        const Kernels* k = kernels_by_name(kernel, &reference);
        if (!k) throw std::invalid_argument(last_error);
        if (cols % (format == 0 ? QK_K : QK32)) throw std::invalid_argument("cols is not a whole number of blocks");
        if (format == 0) (reference ? quantize_act_k : k->quantize_k)(x, cols, (ActK*)out);
        else (reference ? quantize_act_32 : k->quantize_32)(x, cols, (Act32*)out);
    });
}
int sd_dequantize(int type, const void* row, int64_t cols, float* out) {
    return guard([&] {
        if (cols % block_weights(type)) throw std::invalid_argument("cols is not a whole number of blocks");
        dequantize_row(type, row, cols, out);
    });
}

void* sd_model_new(void* pool, const char* kernel, int n_layer, int n_embd, int n_head, int n_kv, int n_ff,
                   int64_t vocab, float eps, float rope_base) {
    return guard_ptr<Model>([&] {
        bool reference;
        const Kernels* k = kernels_by_name(kernel, &reference);
        if (!k) throw std::invalid_argument(last_error);
        if (n_layer < 1 || n_embd < 1 || n_head < 1 || n_kv < 1 || n_head % n_kv || n_embd % n_head ||
            (n_embd / n_head) % 64 || (n_embd / n_head) > 256 || n_ff < 1 || vocab < 1)
            throw std::invalid_argument("unsupported model shape");
        auto* m = new Model();
        m->hp = Hparams{n_layer, n_embd, n_head, n_kv, n_ff, vocab, eps, rope_base};
        m->layers.resize(n_layer);
        m->pool = (Pool*)pool;
        m->kernels = k;
        m->reference = reference;
        return m;
    });
}
void sd_model_free(void* m) { delete (Model*)m; }
const char* sd_model_kernel(void* m) { return ((Model*)m)->reference ? "reference" : ((Model*)m)->kernels->name; }

// A vector of a layer (attn_norm, ffn_norm, bq, bk, bv) or of the model (layer -1: out_norm).
int sd_model_set_vector(void* model, int layer, const char* which, const float* data, int64_t n) {
    return guard([&] {
        Model* m = (Model*)model;
        std::vector<float>* v = nullptr;
        int64_t want = 0;
        const int64_t kvw = m->kv_width();
        if (layer == -1 && !std::strcmp(which, "out_norm")) { v = &m->out_norm; want = m->hp.n_embd; }
        else if (layer >= 0 && layer < (int)m->layers.size()) {
            Layer& L = m->layers[layer];
            if (!std::strcmp(which, "attn_norm")) { v = &L.attn_norm; want = m->hp.n_embd; }
            else if (!std::strcmp(which, "ffn_norm")) { v = &L.ffn_norm; want = m->hp.n_embd; }
            else if (!std::strcmp(which, "bq")) { v = &L.bq; want = m->hp.n_embd; }
            else if (!std::strcmp(which, "bk")) { v = &L.bk; want = kvw; }
            else if (!std::strcmp(which, "bv")) { v = &L.bv; want = kvw; }
        }
        if (!v) throw std::invalid_argument(std::string("no vector ") + which + " in layer " + std::to_string(layer));
        if (n != want) throw std::invalid_argument(std::string(which) + " has " + std::to_string(n) +
                                                   " values, the model needs " + std::to_string(want));
        v->assign(data, data + n);
    });
}

// A matrix of a layer (wq wk wv wo gate up down) or of the model (layer -1: output). The model owns it.
int sd_model_set_matrix(void* model, int layer, const char* which, void* matrix) {
    return guard([&] {
        Model* m = (Model*)model;
        Matrix* w = (Matrix*)matrix;
        Matrix** slot = nullptr;
        int64_t rows = 0, cols = 0;
        const int64_t E = m->hp.n_embd, kvw = m->kv_width(), F = m->hp.n_ff;
        if (layer == -1 && !std::strcmp(which, "output")) { slot = &m->output; rows = m->hp.vocab; cols = E; }
        else if (layer >= 0 && layer < (int)m->layers.size()) {
            Layer& L = m->layers[layer];
            if (!std::strcmp(which, "wq")) { slot = &L.wq; rows = E; cols = E; }
            else if (!std::strcmp(which, "wk")) { slot = &L.wk; rows = kvw; cols = E; }
            else if (!std::strcmp(which, "wv")) { slot = &L.wv; rows = kvw; cols = E; }
            else if (!std::strcmp(which, "wo")) { slot = &L.wo; rows = E; cols = E; }
            else if (!std::strcmp(which, "gate")) { slot = &L.gate; rows = F; cols = E; }
            else if (!std::strcmp(which, "up")) { slot = &L.up; rows = F; cols = E; }
            else if (!std::strcmp(which, "down")) { slot = &L.down; rows = E; cols = F; }
        }
        if (!slot) throw std::invalid_argument(std::string("no matrix ") + which + " in layer " + std::to_string(layer));
        // a cut head (ids: a subset of the vocabulary) is the output's only matrix that holds fewer rows
        if (w->cols() != cols || (w->ids.empty() ? w->rows() != rows : layer != -1))
            throw std::invalid_argument(std::string(which) + " has shape " + std::to_string(w->rows()) + " x " +
                                        std::to_string(w->cols()) + ", the model needs " + std::to_string(rows) +
                                        " x " + std::to_string(cols));
        matrix_free(*slot);
        *slot = w;
    });
}

int sd_model_set_embedding(void* model, int type, const void* data, int64_t rows, int64_t cols) {
    return guard([&] {
        Model* m = (Model*)model;
        if (rows != m->hp.vocab || cols != m->hp.n_embd)
            throw std::invalid_argument("token_embd has the wrong shape");
        if (!supported_type(type) && type != T_F32 && type != T_F16)
            throw std::invalid_argument("token_embd's type is not supported");
        m->embd_type = type;
        m->embd = (const uint8_t*)data;
        m->embd_row_bytes = (size_t)(cols / block_weights(type)) * block_bytes(type);
        if (type == T_F32 || type == T_F16) m->embd_row_bytes = (size_t)cols * block_bytes(type);
    });
}

// Every tensor present; returns 0, or -1 naming the first one missing.
int sd_model_check(void* model) {
    return guard([&] {
        Model* m = (Model*)model;
        if (!m->embd) throw std::invalid_argument("token_embd is missing");
        if (!m->output) throw std::invalid_argument("output is missing");
        if (m->out_norm.empty()) throw std::invalid_argument("output_norm is missing");
        for (size_t l = 0; l < m->layers.size(); l++) {
            const Layer& L = m->layers[l];
            const std::string at = " of layer " + std::to_string(l) + " is missing";
            if (L.attn_norm.empty() || L.ffn_norm.empty()) throw std::invalid_argument("a norm" + at);
            if (L.bq.empty() || L.bk.empty() || L.bv.empty()) throw std::invalid_argument("a Q/K/V bias" + at);
            for (Matrix* w : {L.wq, L.wk, L.wv, L.wo, L.gate, L.up, L.down})
                if (!w) throw std::invalid_argument("a weight matrix" + at);
        }
    });
}

void* sd_seq_new(void* model) { (void)model; return guard_ptr<Seq>([] { return new Seq(); }); }
void sd_seq_free(void* s) { delete (Seq*)s; }
int64_t sd_seq_length(void* s) { return ((Seq*)s)->length; }
int sd_seq_truncate(void* s, int64_t length) {
    return guard([&] {
        Seq* q = (Seq*)s;
        if (length < 0 || length > q->length) throw std::invalid_argument("truncate beyond the cache");
        q->length = length;
    });
}
int sd_seq_keep(void* model, void* s, const int64_t* src, int n) {
    return guard([&] { seq_keep(*(Model*)model, *(Seq*)s, src, n); });
}
int64_t sd_seq_state_bytes(void* model, void* s) { return (int64_t)seq_state_bytes(*(Model*)model, *(Seq*)s); }
int sd_seq_state_get(void* model, void* s, uint8_t* out) {
    return guard([&] { seq_state_get(*(Model*)model, *(Seq*)s, out); });
}
int sd_seq_state_set(void* model, void* s, const uint8_t* in, int64_t nbytes, int64_t length) {
    return guard([&] {
        if (nbytes < 0) throw std::invalid_argument("not a copy of a cache");
        seq_state_set(*(Model*)model, *(Seq*)s, in, (size_t)nbytes, length);
    });
}

// One pass: row r runs n_tokens[r] tokens (concatenated in `tokens`) after sequence seqs[r]'s
// cache; tree[r] != 0 makes it a tree with parents (concatenated like the tokens; ignored
// elsewhere); logits for the last n_logits[r] tokens of each row, rows in order, into `logits`.
int sd_forward(void* model, int n_rows, void** seqs, const int32_t* n_tokens, const int32_t* tokens,
               const int32_t* tree, const int32_t* parents, const int32_t* n_logits, float* logits) {
    return guard([&] {
        std::vector<Row> rows((size_t)n_rows);
        int64_t offset = 0;
        for (int r = 0; r < n_rows; r++) {
            rows[r] = Row{(Seq*)seqs[r], tokens + offset, n_tokens[r], tree[r] ? parents + offset : nullptr, n_logits[r]};
            offset += n_tokens[r];
        }
        forward(*(Model*)model, rows.data(), n_rows, logits);
    });
}

}  // extern "C"
#pragma GCC visibility pop
