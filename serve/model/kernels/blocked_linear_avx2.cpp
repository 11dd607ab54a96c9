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

#include <cstdint>

#include "simd_f32.h"
#include "blocked_linear_impl.h"

namespace at {
namespace native {
// Exported by libtorch_cpu (ATen/native/mkldnn/MKLDNNCommon.cpp; the AOTInductor runtime uses it): an MKLDNN
// tensor viewing data_ptr (not owning it) with the memory descriptor oneDNN serialized for it.
at::Tensor mkldnn_tensor_from_data_ptr(void* data_ptr, at::IntArrayRef dims, at::ScalarType dtype, at::Device device,
                                       const uint8_t* opaque_metadata, int64_t opaque_metadata_size);
}  // namespace native
}  // namespace at

torch::Tensor fp32_blocked_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n_out, int64_t block,
                                  const c10::optional<torch::Tensor>& bias) {
  return blocked_linear<Avx2F>(x, w, n_out, block, bias);
}

torch::Tensor mkldnn_weight_view(const torch::Tensor& w, int64_t n_out, int64_t k_in, const torch::Tensor& md) {
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.device().is_cpu() &&
                  w.numel() == n_out * k_in, "w must be a contiguous fp32 CPU tensor of n_out * k_in values");
  TORCH_CHECK(md.scalar_type() == torch::kUInt8 && md.is_contiguous() && md.dim() == 1,
              "md must be the uint8 memory descriptor oneDNN serialized for this layout");
  return at::native::mkldnn_tensor_from_data_ptr(w.data_ptr(), {n_out, k_in}, torch::kFloat32, w.device(),
                                                 md.data_ptr<uint8_t>(), md.numel());
}
