// Full-precision (fp32) linear for x86 CPUs with AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Why not F.linear: torch's CPU build calls MKL's sgemm, which on AMD CPUs takes a generic path. On the
// project's 2-core AMD EPYC (AVX2, no AVX-512) this is 2x as fast at 1 row and 4.3x at 4 rows
// (python -m bench.quant_kernels; README "fp32 kernels and paged decode attention").
// Above a measured number of rows (kernels/__init__.py: fp32_max_rows) MKL's blocked GEMM is used again.
//
// A register tile of R weight rows x C activation rows keeps R * C fp32 accumulators (8 lanes each) in
// ymm registers: each 8-wide step loads R weight vectors and C activation vectors and issues R * C FMAs,
// so a weight row streamed from memory is used by C activation rows, and the R rows in flight keep the
// hardware prefetchers on R sequential streams. Sums are in fp32 in a fixed order per (n, m): results
// differ from MKL's only by fp32 rounding order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kRows = 4;        // weight rows per register tile
constexpr int kCols = 3;        // activation rows per register tile (4 x 3 = 12 accumulators + 4 loads)
constexpr int64_t kGrain = 16;  // at::parallel_for splits no finer than this many weight rows

// y[m + c, n + r] for r < R, c < C; tail: the mask of the last K % 8 lanes (all zero when K % 8 == 0).
// next: when not null, the R weight rows after this tile's (the next register tile's), prefetched into
// cache while this tile computes, one cache line per row every other 8-wide step.
template <int R, int C>
inline void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n, int64_t m,
                 const float* bias, __m256i tail, const float* next) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* wr[R];
  for (int r = 0; r < R; ++r) wr[r] = w + (n + r) * K;
  const float* xc[C];
  for (int c = 0; c < C; ++c) xc[c] = x + (m + c) * K;
  const int64_t body = K & ~int64_t{7};
  for (int64_t k = 0; k < body; k += 8) {
    if (next != nullptr && (k & 15) == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * K + k), _MM_HINT_T0);
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm256_loadu_ps(xc[c] + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_loadu_ps(wr[r] + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  if (body < K) {  // masked loads read zeros past the row end, so the tail needs no scalar loop
    __m256 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm256_maskload_ps(xc[c] + body, tail);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = _mm256_maskload_ps(wr[r] + body, tail);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      y[(m + c) * N + n + r] = hsum(acc[r][c]) + (bias != nullptr ? bias[n + r] : 0.0f);
}

// Every activation row against weight rows [n, n + R). With several activation tiles the block is
// compute-bound once in cache, so the first tile prefetches the next block's rows (below n_end) and their
// fetch from memory overlaps this block's FMAs; one activation tile is a GEMV, left to the hardware prefetcher.
template <int R>
inline void row_block(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n,
                      int64_t n_end, const float* bias, __m256i tail) {
  const float* next = (M > kCols && n + 2 * R <= n_end) ? w + (n + R) * K : nullptr;
  int64_t m = 0;
  for (; m + kCols <= M; m += kCols, next = nullptr) tile<R, kCols>(x, w, y, K, N, n, m, bias, tail, next);
  if (M - m == 2) tile<R, 2>(x, w, y, K, N, n, m, bias, tail, next);
  if (M - m == 1) tile<R, 1>(x, w, y, K, N, n, m, bias, tail, next);
}

}  // namespace

torch::Tensor fp32_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous fp32 CPU tensor [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  x.device().is_cpu(), "x must be a contiguous fp32 CPU tensor [M, ", K, "]");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous fp32 tensor [", N, "]");
    bp = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = i < (K & 7) ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  at::parallel_for(0, N, kGrain, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + kRows <= n1; n += kRows) row_block<kRows>(xp, wp, yp, M, K, N, n, n1, bp, tail);
    for (; n < n1; ++n) row_block<1>(xp, wp, yp, M, K, N, n, n1, bp, tail);
  });
  return y;
}
