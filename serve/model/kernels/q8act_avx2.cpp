// Weight-only int4 / int8 linears with int8 activations (AVX2 integer dot products), for decode batches.
//
// Why: on AVX2 the fp32-activation kernels (qlinear_avx2.cpp) spend most of their time widening every
// weight to fp32 (byte -> int32 -> float, one shuffle-port op per 8 weights), so on the project's 2-core
// AMD EPYC they run at ~11 GMAC/s and int4 is slower than fp32 when the weights are in cache. With the
// activations rounded to int8, `vpmaddubsw` multiplies 32 weight bytes by 32 activation bytes in one
// instruction and the weights are never widened: the scheme llama.cpp uses for its Q4/Q8 CPU dot products
// (its activations are Q8 blocks of 32 values as well).
//
// What changes against the fp32-activation kernels: the activations only. Each row of x is cut into blocks
// of 32 values; a block's scale is d = max|x| / 127 and its values q = round(x * (127 / max|x|)) (nearest,
// ties to even; all zeros when max|x| == 0). The weights, their scales and zero points are read exactly as
// serve/model/quantized_linear.py stores them. Integer products are exact (int32), then per block:
//   int4: y[n] = sum_g s[g, n] * (sum_{b in g} d_b * sum_j c_j q_j  -  8 * sum_{b in g} d_b * sum_j q_j)
//                + z[g, n] * sum_{k in g} x_k                       (c in 0..15, W = (c - 8) * s + z)
//   int8: y[n] = scale[n] * sum_b d_b * sum_j w_j q_j
// so the only rounding beyond fp32 summation order is the activations' (relative error <= 1/254 of a
// block's largest value).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"
#include "q8act_impl.h"

namespace {

// sum_j u_j * s_j of 32 unsigned bytes u and 32 signed bytes s, as 8 int32 lanes (pairs cannot saturate:
// u <= 128 and |s| <= 127 here, 2 * 128 * 127 < 32767).
struct MaddDot {
  static __m256i dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
};

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> q8_quantize(const torch::Tensor& x) { return q8_quantize_rows(x); }

torch::Tensor int4_linear_q8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
                             int64_t group) {
  return int4_q8<MaddDot>(x, packed, sz, group);
}

torch::Tensor int8_linear_q8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  return int8_q8<MaddDot>(x, w, scales);
}
