// The layout our kernels read: a weight matrix repacked at load into tiles of 16 output rows
// (columns of the result) by one block of inputs, so that one 64-byte load holds 4 consecutive
// weights of each of the 16 rows: exactly the operand of one `vpdpbusd` against 4 activation
// bytes broadcast to every lane. A tile is unpacked once per pass into registers and reused for
// every row of the pass (the point of the kernel: a pass over n tokens reads the weights once).
//
// Weight values are stored unsigned (VNNI multiplies u8 by s8): Q4_K's q (0..15), Q6_K's q
// (0..63), Q5_0's q (0..31) and Q8_0's q + 128; the offsets (-32, -16, -128 times the sum of the
// activations) are exact integers added back, so the integer part of every dot product is the
// one llama.cpp computes from the same blocks. "Group" g of a block: its inputs 4g .. 4g+3.
#pragma once

#include "blocks.h"

namespace sd {

constexpr int TILE = 16;  // output rows per tile

struct TileQ4K {            // 16 rows x 256 inputs; 2368 bytes (GGUF: 2304)
    uint16_t d[TILE], dmin[TILE];
    uint8_t sc[8][TILE];          // sub-block j's 6-bit scale, per row
    uint8_t m[4][TILE][2];        // mins of sub-blocks 2i, 2i+1, per row (an int16 pair each, for vpdpwssd)
    uint8_t qs[8][4][64];         // sub-block j, vector p: byte 4r+i = q of input 32j+4p+i (low nibble)
                                  // and of input 32j+16+4p+i (high nibble), row r
};
struct TileQ6K {            // 16 rows x 256 inputs; 3392 bytes (GGUF: 3360)
    uint16_t d[TILE];
    int8_t sc[16][TILE];          // sub-block j (16 inputs), per row
    uint8_t pad[32];              // the vectors below start on a cache line
    struct {                      // sub-block pair s (inputs 32s .. 32s+31), its vectors side by side: one stream
        uint8_t ql[4][64];        // vector p: low 4 bits of input 32s+4p+i (low nibble), of 32s+16+4p+i (high)
        uint8_t qh[2][64];        // vector h: bits 2t, 2t+1 = high 2 bits of group 4h+t of the pair
    } pair[8];
};
struct TileQ5_0 {           // 16 rows x 32 inputs; 352 bytes (GGUF: 352)
    uint16_t d[TILE];
    uint8_t qs[4][64];            // vector p: low 4 bits of group p (low nibble) and group p+4 (high nibble)
    uint8_t qh[64];               // bit g of byte 4r+i: the high bit of input 4g+i, row r
};
struct TileQ8_0 {           // 16 rows x 32 inputs; 544 bytes (GGUF: 544)
    uint16_t d[TILE];
    uint8_t q[8][64];             // group g: q + 128 of input 4g+i, row r, at byte 4r+i
};
static_assert(sizeof(TileQ4K) == 2368 && sizeof(TileQ6K) == 3392, "K-quant tiles");
static_assert(sizeof(TileQ5_0) == 352 && sizeof(TileQ8_0) == 544, "32-block tiles");

inline size_t tile_bytes(int type) {
    switch (type) {
        case T_Q4_K: return sizeof(TileQ4K);
        case T_Q6_K: return sizeof(TileQ6K);
        case T_Q5_0: return sizeof(TileQ5_0);
        case T_Q8_0: return sizeof(TileQ8_0);
    }
    return 0;
}

// A repacked matrix: tiles[t * blocks + b] is row tile t (rows 16t .. 16t+15), input block b.
struct Packed {
    int type = 0;
    int64_t rows = 0, cols = 0;     // rows beyond `rows` in the last tile are zero weights
    int64_t row_tiles = 0, blocks = 0;
    uint8_t* data = nullptr;        // 64-byte aligned
    size_t bytes = 0;
    const uint8_t* tile(int64_t t, int64_t b) const { return data + (t * blocks + b) * tile_bytes(type); }
};

}  // namespace sd
