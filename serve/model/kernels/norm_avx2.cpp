// Llama's RMSNorm over fp32 rows (AVX2 + FMA), alone or fused with the residual add before it.
//
// Why: in torch the norm is six small ops (pow, mean, add, rsqrt, mul, mul), each a pass over the rows with
// its own temporary and dispatch; a decode step runs 61 of them, and at batch 1 that overhead is a visible
// share of the step. Here one pass reads the row for the sum of squares and one writes the result, and
// add_rms_norm_ also folds in the residual add (h += delta) that precedes every norm but the first.
//
// Math per row (as HF, in fp32): y = w * (x * 1 / sqrt(mean(x^2) + eps)). The sum of squares runs in fp32
// in another order than torch's reduction: results differ from the torch formula by fp32 rounding only.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kGrain = 256;  // rows per thread at least: decode batches run inline, without a fork

// y = norm(x) * w for one row of D floats; with ADD, x += delta first (x is written back).
template <bool ADD>
inline void norm_row(float* x, const float* delta, const float* w, float* y, int64_t D, float eps) {
  const int64_t body = D & ~int64_t{7};
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d < body; d += 8) {
    __m256 v = _mm256_loadu_ps(x + d);
    if (ADD) {
      v = _mm256_add_ps(v, _mm256_loadu_ps(delta + d));
      _mm256_storeu_ps(x + d, v);
    }
    if ((d & 8) == 0) s0 = _mm256_fmadd_ps(v, v, s0);
    else s1 = _mm256_fmadd_ps(v, v, s1);
  }
  float ss = hsum(_mm256_add_ps(s0, s1));
  for (; d < D; ++d) {
    if (ADD) x[d] += delta[d];
    ss += x[d] * x[d];
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  const __m256 vr = _mm256_set1_ps(r);
  for (d = 0; d < body; d += 8)
    _mm256_storeu_ps(y + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(x + d), vr)));
  for (; d < D; ++d) y[d] = w[d] * (x[d] * r);
}

void check(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              name, " must be a contiguous fp32 CPU tensor [rows, hidden]");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == x.size(1),
              "weight must be a contiguous fp32 tensor [", x.size(1), "]");
}

template <bool ADD>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor* delta, const torch::Tensor& w, double eps) {
  auto y = torch::empty_like(x);
  const int64_t M = x.size(0), D = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* dp = ADD ? delta->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, kGrain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row<ADD>(xp + m * D, ADD ? dp + m * D : nullptr, wp, yp + m * D, D, e);
  });
  return y;
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check(x, w, "x");
  return run<false>(x, nullptr, w, eps);
}

torch::Tensor add_rms_norm_(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w, double eps) {
  check(h, w, "h");
  TORCH_CHECK(delta.sizes() == h.sizes() && delta.scalar_type() == torch::kFloat32 && delta.is_contiguous() &&
                  delta.device().is_cpu(), "delta must be a contiguous fp32 CPU tensor shaped like h");
  return run<true>(h, &delta, w, eps);
}
