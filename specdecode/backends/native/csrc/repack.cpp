// GGUF rows -> tiles (tiles.h). Runs once at load, in parallel over row tiles.
#include "repack.h"

#include <cstdlib>
#include <sys/mman.h>
#include <stdexcept>

namespace sd {

namespace {

void pack_q4k(const BlockQ4K* rows[TILE], TileQ4K& t) {
    std::memset(&t, 0, sizeof(t));
    for (int r = 0; r < TILE; r++) {
        if (!rows[r]) continue;  // padding row: zero weights, zero scales
        const BlockQ4K& b = *rows[r];
        t.d[r] = b.d;
        t.dmin[r] = b.dmin;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            q4k_scale_min(j, b.scales, &sc, &m);
            t.sc[j][r] = sc;
            t.m[j / 2][r][j % 2] = m;
        }
        for (int j = 0; j < 8; j++)
            for (int p = 0; p < 4; p++)
                for (int i = 0; i < 4; i++)
                    t.qs[j][p][4 * r + i] = (uint8_t)(q4k_value(b, 32 * j + 4 * p + i) |
                                                      q4k_value(b, 32 * j + 16 + 4 * p + i) << 4);
    }
}

void pack_q6k(const BlockQ6K* rows[TILE], TileQ6K& t) {
    std::memset(&t, 0, sizeof(t));
    for (int r = 0; r < TILE; r++) {
        if (!rows[r]) continue;
        const BlockQ6K& b = *rows[r];
        t.d[r] = b.d;
        for (int j = 0; j < 16; j++) t.sc[j][r] = b.scales[j];
        for (int s = 0; s < 8; s++) {
            for (int p = 0; p < 4; p++)
                for (int i = 0; i < 4; i++) {
                    int lo = q6k_value(b, 32 * s + 4 * p + i), hi = q6k_value(b, 32 * s + 16 + 4 * p + i);
                    t.pair[s].ql[p][4 * r + i] = (uint8_t)((lo & 0xF) | (hi & 0xF) << 4);
                }
            for (int g = 0; g < 8; g++)
                for (int i = 0; i < 4; i++)
                    t.pair[s].qh[g / 4][4 * r + i] |= (uint8_t)((q6k_value(b, 32 * s + 4 * g + i) >> 4) << (2 * (g % 4)));
        }
    }
}

void pack_q5_0(const BlockQ5_0* rows[TILE], TileQ5_0& t) {
    std::memset(&t, 0, sizeof(t));
    for (int r = 0; r < TILE; r++) {
        if (!rows[r]) continue;
        const BlockQ5_0& b = *rows[r];
        t.d[r] = b.d;
        for (int g = 0; g < 8; g++)
            for (int i = 0; i < 4; i++) {
                int q = q5_0_value(b, 4 * g + i);
                if (g < 4) t.qs[g][4 * r + i] |= (uint8_t)(q & 0xF);
                else t.qs[g - 4][4 * r + i] |= (uint8_t)((q & 0xF) << 4);
                t.qh[4 * r + i] |= (uint8_t)((q >> 4) << g);
            }
    }
}

void pack_q8_0(const BlockQ8_0* rows[TILE], TileQ8_0& t) {
    std::memset(&t, 0, sizeof(t));
    for (int g = 0; g < 8; g++)
        for (int k = 0; k < 64; k++) t.q[g][k] = 128;  // padding rows: q = 0
    for (int r = 0; r < TILE; r++) {
        if (!rows[r]) continue;
        const BlockQ8_0& b = *rows[r];
        t.d[r] = b.d;
        for (int g = 0; g < 8; g++)
            for (int i = 0; i < 4; i++) t.q[g][4 * r + i] = (uint8_t)(b.qs[4 * g + i] + 128);
    }
}

template <class Block, class Tile>
void pack_tiles(const Packed& p, const uint8_t* src, size_t row_bytes, const int32_t* ids, int64_t t0, int64_t t1,
                void (*pack)(const Block**, Tile&)) {
    const Block* rows[TILE];
    for (int64_t t = t0; t < t1; t++)
        for (int64_t b = 0; b < p.blocks; b++) {
            for (int r = 0; r < TILE; r++) {
                int64_t row = t * TILE + r;
                rows[r] = row < p.rows ? (const Block*)(src + (ids ? ids[row] : row) * row_bytes) + b : nullptr;
            }
            pack(rows, *(Tile*)p.tile(t, b));
        }
}

}  // namespace

bool packable(int type, int64_t cols) { return supported_type(type) && cols > 0 && cols % block_weights(type) == 0; }

Packed pack_alloc(int type, int64_t rows, int64_t cols) {
    if (!packable(type, cols)) throw std::invalid_argument("unsupported tensor type or shape");
    Packed p;
    p.type = type;
    p.rows = rows;
    p.cols = cols;
    p.row_tiles = (rows + TILE - 1) / TILE;
    p.blocks = cols / block_weights(type);
    p.bytes = (size_t)(p.row_tiles * p.blocks) * tile_bytes(type);
    // 2 MB pages where the kernel gives them (transparent huge pages on request): a pass streams
    // the whole matrix, and with 4 KB pages every page boundary costs a TLB miss and stops the
    // hardware prefetcher
    const size_t huge = 2u << 20, size = p.bytes >= huge ? (p.bytes + huge - 1) / huge * huge : (p.bytes + 63) / 64 * 64;
    void* mem = nullptr;
    if (posix_memalign(&mem, size >= huge ? huge : 64, size) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
    madvise(mem, size, MADV_HUGEPAGE);
#endif
    p.data = (uint8_t*)mem;
    return p;
}

void pack_range(const Packed& p, const void* gguf, const int32_t* ids, int64_t t0, int64_t t1) {
    const uint8_t* src = (const uint8_t*)gguf;
    const size_t row_bytes = (size_t)p.blocks * block_bytes(p.type);
    switch (p.type) {
        case T_Q4_K: pack_tiles<BlockQ4K, TileQ4K>(p, src, row_bytes, ids, t0, t1, pack_q4k); break;
        case T_Q6_K: pack_tiles<BlockQ6K, TileQ6K>(p, src, row_bytes, ids, t0, t1, pack_q6k); break;
        case T_Q5_0: pack_tiles<BlockQ5_0, TileQ5_0>(p, src, row_bytes, ids, t0, t1, pack_q5_0); break;
        case T_Q8_0: pack_tiles<BlockQ8_0, TileQ8_0>(p, src, row_bytes, ids, t0, t1, pack_q8_0); break;
    }
}

void pack_free(Packed& p) {
    std::free(p.data);
    p.data = nullptr;
}

}  // namespace sd
