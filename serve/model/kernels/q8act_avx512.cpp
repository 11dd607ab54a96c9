// The int8-activation kernels (q8act_impl.h; what and why: q8act_avx2.cpp) with AVX-512 VNNI's vpdpbusd on 256-bit
// vectors (AVX512_VNNI + AVX512VL): one instruction for the 32 unsigned x signed byte products of a block summed in
// fours, where AVX2 needs vpmaddubsw + vpmaddwd. The int32 lanes are the same (exact integer sums, no int16
// saturation either way here), so every output equals the AVX2 variant's bit for bit, and the row-alone contract
// carries over. Compiled only into the AVX-512 module (serve/model/kernels/isa.py), with its flags.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"
#include "q8act_impl.h"

namespace {

struct VnniDot {
  static __m256i dot(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
};

}  // namespace

namespace avx512 {

torch::Tensor int4_linear_q8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
                             int64_t group) {
  return int4_q8<VnniDot>(x, packed, sz, group);
}

torch::Tensor int8_linear_q8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  return int8_q8<VnniDot>(x, w, scales);
}

}  // namespace avx512
