// fp32 linear over a weight stored in oneDNN's blocked ("packed") layout, for the few-row case (decode of a
// handful of sequences, a speculative verify of a few tokens each), with AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias).
//
// Why: full-precision weights live in the arena in the layout oneDNN's matmul reads fastest (serve/model/
// linear.py, BlockedLayout), so batched steps run oneDNN on them without a packed second copy. oneDNN's own
// kernel on that layout is slower than a plain GEMV at one row; this kernel reads the same bytes at one to a
// few dozen rows. Layout: W[n, k] lies at (n / B) * K * B + k * B + n % B (B = 64 on the Zen 4 VM, also with oneDNN
// capped at AVX2; the Python side probes B and falls back to the plain layout when oneDNN chose anything else).
//
// Row invariance (what self-speculative decoding's exactness rests on, serve/engine/spec_executor.py): every
// output y[m, n] is one fp32 FMA chain over k = 0, 1, ..., K - 1 starting from zero, the bias added last, whatever
// M is and however the rows are tiled; so a row computed beside others equals the row computed alone, bit for bit
// (tests/model/test_blocked_linear.py checks it at every row count that takes another path).
//
// One row: a tile of NV * 8 weight rows keeps NV ymm accumulators; each k step loads NV contiguous weight vectors
// and broadcasts the activation, so the block is streamed front to back (what a GEMV needs).
// Several rows: each task owns whole 64-row blocks (a block's k-th 64 floats are contiguous, so one block is one
// sequential stream) and sweeps it in chunks of KC k's: the first activation row streams a chunk from memory, the
// others read it back from L1, each row's 64 accumulators saved in a small buffer between chunks. Measured on the
// 2-core Zen 4 VM (30 decoder layers' projections streamed, bench.quant_kernels --streamed): 5 rows cost 1.2x one
// row instead of the 2.6x of tiling the rows over 16-row panels.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
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

constexpr int64_t KC = 64;  // k per chunk: a 64-row block's chunk is 16 KB, L1-resident while every row reads it
constexpr int64_t MG = 48;  // activation rows per sweep of the weights (the accumulator buffer's rows)

// One activation row against the NV * 8 weight rows at wb for k in [k0, k1), its accumulators in acc.
template <int NV>
inline void chunk_row(const float* x, const float* wb, int64_t B, int64_t k0, int64_t k1, float* acc, bool first) {
  __m256 a[NV];
  for (int j = 0; j < NV; ++j) a[j] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + 8 * j);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = wb + k * B;
    const __m256 xv = _mm256_broadcast_ss(x + k);
    for (int j = 0; j < NV; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(wk + 8 * j), xv, a[j]);
  }
  for (int j = 0; j < NV; ++j) _mm256_store_ps(acc + 8 * j, a[j]);
}

// y[n .. n + 8 * NV) = acc (+ bias).
template <int NV>
inline void store_row(const float* acc, float* y, int64_t n, const float* bias) {
  for (int j = 0; j < NV; ++j) {
    __m256 v = _mm256_load_ps(acc + 8 * j);
    if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n + 8 * j));
    _mm256_storeu_ps(y + n + 8 * j, v);
  }
}

// One activation row against the NV * 8 weight rows starting at n: the whole of k as one chunk.
template <int NV>
inline void gemv(const float* x, const float* wb, float* y, int64_t K, int64_t B, int64_t n, const float* bias) {
  alignas(32) float acc[NV * 8];
  chunk_row<NV>(x, wb, B, 0, K, acc, true);
  store_row<NV>(acc, y, n, bias);
}

// All M activation rows against the W = NV * 8 weight rows starting at n (inside one block; wb points at them).
template <int NV>
void several_rows(const float* x, const float* wb, float* y, int64_t M, int64_t K, int64_t N, int64_t B, int64_t n,
                  const float* bias) {
  constexpr int W = NV * 8;
  alignas(32) float acc[MG * W];
  for (int64_t g = 0; g < M; g += MG) {
    const int64_t rows = std::min<int64_t>(MG, M - g);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t k1 = std::min<int64_t>(K, k0 + KC);
      for (int64_t r = 0; r < rows; ++r) chunk_row<NV>(x + (g + r) * K, wb, B, k0, k1, acc + r * W, k0 == 0);
    }
    for (int64_t r = 0; r < rows; ++r) store_row<NV>(acc + r * W, y + (g + r) * N, n, bias);
  }
}

template <int NV>
void several_rows_all(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t B,
                      const float* bias) {
  constexpr int64_t W = NV * 8;
  at::parallel_for(0, N / W, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * W;
      several_rows<NV>(x, w + (n / B) * K * B + n % B, y, M, K, N, B, n, bias);
    }
  });
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
  if (M >= 2) {  // task width: a whole 64-row block where the layout's blocks allow it
    if (B % 64 == 0) several_rows_all<8>(xp, wp, yp, M, K, N, B, bp);
    else if (B % 32 == 0) several_rows_all<4>(xp, wp, yp, M, K, N, B, bp);
    else several_rows_all<2>(xp, wp, yp, M, K, N, B, bp);
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
        gemv<8>(xp, wb, yp, K, B, n, bp);
        p += 4;
      } else if (left >= 32 && p + 2 <= p1) {
        gemv<4>(xp, wb, yp, K, B, n, bp);
        p += 2;
      } else {
        gemv<2>(xp, wb, yp, K, B, n, bp);
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
