#pragma once

#include "tiles.h"

namespace sd {

bool packable(int type, int64_t cols);
// Allocates the tiles of a rows x cols matrix (throws std::invalid_argument for a type or shape
// the kernels do not take); pack_range fills row tiles [t0, t1) from the GGUF rows (`ids`: the
// GGUF row of each packed row, for a subset such as a draft's cut output head; null: all rows).
Packed pack_alloc(int type, int64_t rows, int64_t cols);
void pack_range(const Packed& p, const void* gguf, const int32_t* ids, int64_t t0, int64_t t1);
void pack_free(Packed& p);

}  // namespace sd
