// The kernels for avx512-vnni (kernels_impl.inc over V), compiled for that instruction set only:
// every standard header comes before the target pragma, and the code lives in its own namespace,
// so nothing compiled here is shared with (or picked by the linker for) another path.
#include "kernels.h"

#if defined(__x86_64__)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>


#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#endif

namespace sd {
namespace isa_avx512_vnni {
#include "simd_avx512.inc"

#include "kernels_impl.inc"
}  // namespace isa_avx512_vnni

const Kernels kernels_avx512_vnni = {"avx512-vnni", isa_avx512_vnni::gemm_k, isa_avx512_vnni::gemm_32, isa_avx512_vnni::attend, isa_avx512_vnni::quantize_k, isa_avx512_vnni::quantize_32, isa_avx512_vnni::silu_mul};
}  // namespace sd

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#else  // no x86 SIMD: the table is empty and never chosen (api.cpp: cpu_flags() is 0)
namespace sd {
const Kernels kernels_avx512_vnni = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
}
#endif
