// The fp32 linear over oneDNN's blocked layout, written once over the vector traits of simd_f32.h and compiled
// per ISA (blocked_linear_avx2.cpp, blocked_linear_avx512.cpp); what it does and why: blocked_linear_avx2.cpp.
// Include it after <torch/extension.h>, <ATen/Parallel.h> and simd_f32.h (its templates have internal linkage).
#pragma once

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t KC = 64;  // k per chunk: a 64-row block's chunk is 16 KB, L1-resident while every row reads it
constexpr int64_t MG = 48;  // activation rows per sweep of the weights (the accumulator buffer's rows)

// One activation row against the NV * S::kLanes weight rows at wb for k in [k0, k1), its accumulators in acc.
template <class S, int NV>
inline void chunk_row(const float* x, const float* wb, int64_t B, int64_t k0, int64_t k1, float* acc, bool first) {
  typename S::V a[NV];
  for (int j = 0; j < NV; ++j) a[j] = first ? S::zero() : S::load(acc + S::kLanes * j);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = wb + k * B;
    const typename S::V xv = S::broadcast(x + k);
    for (int j = 0; j < NV; ++j) a[j] = S::fmadd(S::loadu(wk + S::kLanes * j), xv, a[j]);
  }
  for (int j = 0; j < NV; ++j) S::store(acc + S::kLanes * j, a[j]);
}

// y[n .. n + S::kLanes * NV) = acc (+ bias).
template <class S, int NV>
inline void store_row(const float* acc, float* y, int64_t n, const float* bias) {
  for (int j = 0; j < NV; ++j) {
    typename S::V v = S::load(acc + S::kLanes * j);
    if (bias != nullptr) v = S::add(v, S::loadu(bias + n + S::kLanes * j));
    S::storeu(y + n + S::kLanes * j, v);
  }
}

// One activation row against the W weight rows starting at n: the whole of k as one chunk.
template <class S, int W>
inline void gemv(const float* x, const float* wb, float* y, int64_t K, int64_t B, int64_t n, const float* bias) {
  alignas(64) float acc[W];
  chunk_row<S, W / S::kLanes>(x, wb, B, 0, K, acc, true);
  store_row<S, W / S::kLanes>(acc, y, n, bias);
}

// All M activation rows against the W weight rows starting at n (inside one block; wb points at them).
template <class S, int W>
void several_rows(const float* x, const float* wb, float* y, int64_t M, int64_t K, int64_t N, int64_t B, int64_t n,
                  const float* bias) {
  constexpr int NV = W / S::kLanes;
  alignas(64) float acc[MG * W];
  for (int64_t g = 0; g < M; g += MG) {
    const int64_t rows = std::min<int64_t>(MG, M - g);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t k1 = std::min<int64_t>(K, k0 + KC);
      for (int64_t r = 0; r < rows; ++r) chunk_row<S, NV>(x + (g + r) * K, wb, B, k0, k1, acc + r * W, k0 == 0);
    }
    for (int64_t r = 0; r < rows; ++r) store_row<S, NV>(acc + r * W, y + (g + r) * N, n, bias);
  }
}

template <class S, int W>
void several_rows_all(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t B,
                      const float* bias) {
  at::parallel_for(0, N / W, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * W;
      several_rows<S, W>(x, w + (n / B) * K * B + n % B, y, M, K, N, B, n, bias);
    }
  });
}

// y = x @ W^T (+ bias) with S's vectors (the op fp32_blocked_linear of each ISA's module).
template <class S>
torch::Tensor blocked_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n_out, int64_t block,
                             const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.device().is_cpu(),
              "w must be a contiguous fp32 CPU tensor in the blocked layout");
  TORCH_CHECK(block > 0 && block % 16 == 0 && n_out % block == 0, "n_out (", n_out, ") must be a multiple of block (",
              block, "), a multiple of 16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous fp32 CPU tensor [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = n_out, B = block;
  TORCH_CHECK(w.numel() == N * K, "w holds ", w.numel(), " values, not n_out * K = ", N * K);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == N,
                "bias must be a contiguous fp32 tensor [", N, "]");
    bp = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M >= 2) {  // task width: a whole 64-row block where the layout's blocks allow it
    if (B % 64 == 0) several_rows_all<S, 64>(xp, wp, yp, M, K, N, B, bp);
    else if (B % 32 == 0) several_rows_all<S, 32>(xp, wp, yp, M, K, N, B, bp);
    else several_rows_all<S, 16>(xp, wp, yp, M, K, N, B, bp);
    return y;
  }
  // one row: one 16-row panel per task, fine enough for 2+ threads on the smallest projection
  at::parallel_for(0, N / 16, 1, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
    while (p < p1) {
      const int64_t n = p * 16;
      const float* wb = wp + (n / B) * K * B + n % B;
      // 64 rows (a sequential stream of a whole block when B is 64), 32, else 16; a panel never crosses a block
      // boundary (the next block's rows lie K * B floats further)
      const int64_t left = B - n % B;
      if (left >= 64 && p + 4 <= p1) {
        gemv<S, 64>(xp, wb, yp, K, B, n, bp);
        p += 4;
      } else if (left >= 32 && p + 2 <= p1) {
        gemv<S, 32>(xp, wb, yp, K, B, n, bp);
        p += 2;
      } else {
        gemv<S, 16>(xp, wb, yp, K, B, n, bp);
        p += 1;
      }
    }
  });
  return y;
}

}  // namespace
