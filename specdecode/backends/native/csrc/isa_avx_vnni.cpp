// The kernels for avx-vnni (kernels_impl.inc over V256<true>), compiled for that instruction set only:
// every standard header comes before the target pragma, and the code lives in its own namespace,
// so nothing compiled here is shared with (or picked by the linker for) another path.
#include "kernels.h"

#if defined(__x86_64__)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>


#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif

namespace sd {
namespace isa_avx_vnni {
#include "simd_avx2.inc"
using V = V256<true>;
#include "kernels_impl.inc"
}  // namespace isa_avx_vnni

const Kernels kernels_avx_vnni = {"avx-vnni", isa_avx_vnni::gemm_k, isa_avx_vnni::gemm_32, isa_avx_vnni::attend, isa_avx_vnni::quantize_k, isa_avx_vnni::quantize_32, isa_avx_vnni::silu_mul};
}  // namespace sd

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no x86 SIMD: the table is empty and never chosen (api.cpp: cpu_flags() is 0)
namespace sd {
const Kernels kernels_avx_vnni = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
}
#endif
