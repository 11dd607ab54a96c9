// fp32 linear over a weight stored in oneDNN's blocked ("packed") layout, for the few-row case (decode of a
// handful of sequences), with AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Why: full-precision weights live in the arena in the layout oneDNN's matmul reads fastest (serve/model/
// linear.py, BlockedLayout), so batched steps run oneDNN on them without a packed second copy. oneDNN's own
// kernel on that layout is slower than a plain GEMV at one row; this kernel reads the same bytes at one to a
// few rows. Layout: W[n, k] lies at (n / B) * K * B + k * B + n % B (B = 64 on the Zen 4 VM, also with oneDNN
// capped at AVX2; the Python side probes B and falls back to the plain layout when oneDNN chose anything else).
//
// A tile of MR activation rows x NV * 8 weight rows keeps MR * NV ymm accumulators; each k step loads NV
// contiguous weight vectors and broadcasts MR activations: the block is streamed front to back, so one
// activation row is a pure sequential read of the weights (what a GEMV needs). Sums are fp32 in k order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

namespace at {
namespace native {
// Exported by libtorch_cpu (ATen/native/mkldnn/MKLDNNCommon.cpp; the AOTInductor runtime uses it): an MKLDNN
// tensor viewing data_ptr (not owning it) with the memory descriptor oneDNN serialized for it.
at::Tensor mkldnn_tensor_from_data_ptr(void* data_ptr, at::IntArrayRef dims, at::ScalarType dtype, at::Device device,
                                       const uint8_t* opaque_metadata, int64_t opaque_metadata_size);
}  // namespace native
}  // namespace at

namespace {

template <int MR, int NV>
inline void tile(const float* x, const float* wb, float* y, int64_t K, int64_t N, int64_t B, int64_t n, int64_t m,
                 const float* bias) {
  __m256 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* xr[MR];
  for (int r = 0; r < MR; ++r) xr[r] = x + (m + r) * K;
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = wb + k * B;
    __m256 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = _mm256_broadcast_ss(xr[r] + k);
    for (int j = 0; j < NV; ++j) {
      const __m256 wv = _mm256_loadu_ps(wk + 8 * j);
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(wv, xv[r], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) {
      __m256 v = acc[r][j];
      if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n + 8 * j));
      _mm256_storeu_ps(y + (m + r) * N + n + 8 * j, v);
    }
}

// Every activation row against the NV * 8 weight rows starting at n (inside one block; wb points at them).
template <int NV, int MR>
inline void rows(const float* x, const float* wb, float* y, int64_t M, int64_t K, int64_t N, int64_t B, int64_t n,
                 const float* bias) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, NV>(x, wb, y, K, N, B, n, m, bias);
  switch (M - m) {
    case 3: tile<3, NV>(x, wb, y, K, N, B, n, m, bias); break;
    case 2: tile<2, NV>(x, wb, y, K, N, B, n, m, bias); break;
    case 1: tile<1, NV>(x, wb, y, K, N, B, n, m, bias); break;
    default: break;
  }
}

}  // namespace

torch::Tensor fp32_blocked_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n_out, int64_t block,
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
  // one 16-row panel per task: fine enough for 2+ threads on the smallest projection
  at::parallel_for(0, N / 16, 1, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
    while (p < p1) {
      const int64_t n = p * 16;
      const float* wb = wp + (n / B) * K * B + n % B;
      // 64 rows at one row (a sequential stream of a whole block when B is 64), 32 at two, 16 otherwise; a
      // panel never crosses a block boundary (the next block's rows lie K * B floats further)
      const int64_t left = B - n % B;
      if (M == 1 && left >= 64 && p + 4 <= p1) {
        rows<8, 1>(xp, wb, yp, M, K, N, B, n, bp);
        p += 4;
      } else if (M <= 2 && left >= 32 && p + 2 <= p1) {
        rows<4, 2>(xp, wb, yp, M, K, N, B, n, bp);
        p += 2;
      } else {
        rows<2, 4>(xp, wb, yp, M, K, N, B, n, bp);
        p += 1;
      }
    }
  });
  return y;
}

torch::Tensor mkldnn_weight_view(const torch::Tensor& w, int64_t n_out, int64_t k_in, const torch::Tensor& md) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.device().is_cpu() &&
                  w.numel() == n_out * k_in, "w must be a contiguous fp32 CPU tensor of n_out * k_in values");
  TORCH_CHECK(md.scalar_type() == torch::kUInt8 && md.is_contiguous() && md.dim() == 1,
              "md must be the uint8 memory descriptor oneDNN serialized for this layout");
  return at::native::mkldnn_tensor_from_data_ptr(w.data_ptr(), {n_out, k_in}, torch::kFloat32, w.device(),
                                                 md.data_ptr<uint8_t>(), md.numel());
}
