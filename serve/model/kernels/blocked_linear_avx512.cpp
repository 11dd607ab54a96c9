// The fp32 linear over oneDNN's blocked layout (blocked_linear_impl.h; what and why: blocked_linear_avx2.cpp) with
// 16-wide AVX-512 vectors: half the loads and FMAs per k step of the AVX2 variant. Each output is the same single
// FMA chain over k in order from zero, bias added last, so it equals the AVX2 variant's bit for bit and a row
// computed with others equals it computed alone. Compiled only into the AVX-512 module, with its flags.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

#include "simd_f32.h"
#include "blocked_linear_impl.h"

namespace avx512 {

torch::Tensor fp32_blocked_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n_out, int64_t block,
                                  const c10::optional<torch::Tensor>& bias) {
  return blocked_linear<Avx512F>(x, w, n_out, block, bias);
}

}  // namespace avx512
