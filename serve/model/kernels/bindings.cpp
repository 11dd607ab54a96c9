// The one Python module of the CPU kernels: the int8 / int4 kernels (qlinear_avx2.cpp; with int8 activations q8act_avx2.cpp), the fp32 linears
// (linear_avx2.cpp, blocked_linear_avx2.cpp), paged decode and prompt attention (attention_avx2.cpp; over 8-bit KV attention_q8_avx2.cpp,
// over tables mixing the two attention_mixed_avx2.cpp), RMSNorm (norm_avx2.cpp) and the fused SwiGLU / RoPE + KV write
// (elementwise_avx2.cpp), compiled together by serve/model/kernels/__init__.py.
#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales);
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz, int64_t group);
torch::Tensor int8_linear_q8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales);
torch::Tensor int4_linear_q8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz, int64_t group);
std::tuple<torch::Tensor, torch::Tensor> q8_quantize(const torch::Tensor& x);
torch::Tensor int8_block_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d);
torch::Tensor int4_dequantize(const torch::Tensor& packed, const torch::Tensor& sz, int64_t group);
torch::Tensor fp32_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
torch::Tensor fp32_blocked_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n_out, int64_t block,
                                  const c10::optional<torch::Tensor>& bias);
torch::Tensor mkldnn_weight_view(const torch::Tensor& w, int64_t n_out, int64_t k_in, const torch::Tensor& md);
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& blocks, const torch::Tensor& k_index,
                                     int64_t layer, int64_t v_offset, const torch::Tensor& lens, double scale);
torch::Tensor paged_decode_attention_q8(const torch::Tensor& q, const torch::Tensor& codes, const torch::Tensor& scales,
                                        const torch::Tensor& k_index, const torch::Tensor& s_index, int64_t layer,
                                        int64_t v_offset, const torch::Tensor& lens, double scale);
torch::Tensor paged_decode_attention_mixed(const torch::Tensor& q, const torch::Tensor& blocks,
                                           const torch::Tensor& codes, const torch::Tensor& scales,
                                           const torch::Tensor& k_index, const torch::Tensor& s_index,
                                           const torch::Tensor& is8, int64_t layer, int64_t v_offset,
                                           const torch::Tensor& lens, double scale);
void prefill_attention_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                        double scale);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor add_rms_norm_(const torch::Tensor& h, const torch::Tensor& delta, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gu);
void rope_kv_write_(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                    int64_t kv_heads, const torch::Tensor& storage, const torch::Tensor& k_rows, int64_t layer_offset,
                    int64_t v_offset);
void rope_kv_write_q8_(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                       int64_t kv_heads, const torch::Tensor& storage, const torch::Tensor& codes,
                       const torch::Tensor& scales, const torch::Tensor& k_rows, const torch::Tensor& scale_rows,
                       const torch::Tensor& is8, int64_t layer_offset, int64_t v_offset);

// Executes one instruction of each extension the module is compiled for and returns what they computed (the ISA
// probe's child process compares it with the expected value, serve/model/kernels/isa.py): FMA (8-wide fmadd) and
// AVX2 (vpmaddubsw + vpmaddwd, the int8-activation kernels' dot product).
int64_t probe() {
  alignas(32) uint8_t u[32];
  alignas(32) int8_t s[32];
  for (int i = 0; i < 32; ++i) {
    u[i] = static_cast<uint8_t>(i + 1);
    s[i] = static_cast<int8_t>(i % 2 == 0 ? 1 : -2);
  }
  const __m256i uy = _mm256_load_si256(reinterpret_cast<const __m256i*>(u));
  const __m256i sy = _mm256_load_si256(reinterpret_cast<const __m256i*>(s));
  const __m256i dy = _mm256_madd_epi16(_mm256_maddubs_epi16(uy, sy), _mm256_set1_epi16(1));
  const __m256 f = _mm256_fmadd_ps(_mm256_set1_ps(1.5f), _mm256_set1_ps(2.0f), _mm256_set1_ps(0.25f));
  alignas(32) int32_t iy[8];
  alignas(32) float fy[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(iy), dy);
  _mm256_store_ps(fy, f);
  int64_t total = 0;
  for (int i = 0; i < 8; ++i) total += iy[i] + static_cast<int64_t>(fy[i] * 4.0f);  // 8 * 13 = 104 from the FMAs
  return total;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("probe", &probe, "execute one instruction of each ISA extension this module uses; returns a checksum");
  m.def("int8_linear", &int8_linear, "y = x @ (q * scale)^T, fp32 accumulation");
  m.def("int4_linear", &int4_linear, "y = x @ ((c - 8) * s + z)^T, blocked int4 codes, fp32 accumulation");
  m.def("int8_linear_q8", &int8_linear_q8, "int8_linear with activations rounded to int8 blocks of 32 (q8act_avx2.cpp)");
  m.def("int4_linear_q8", &int4_linear_q8, "int4_linear with activations rounded to int8 blocks of 32 (q8act_avx2.cpp)");
  m.def("q8_quantize", &q8_quantize, "the int8 activation blocks those kernels use: (q int8 [M, K], d fp32 [M, K/32])");
  m.def("int8_block_linear", &int8_block_linear, "y = x @ (q * d per 32 inputs)^T, Q8_0 blocks, fp32 accumulation");
  m.def("int4_dequantize", &int4_dequantize, "fp32 [N, K] from blocked int4 codes");
  m.def("fp32_linear", &fp32_linear, "y = x @ w^T (+ bias), fp32, register-tiled for small row counts",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias") = pybind11::none());
  m.def("fp32_blocked_linear", &fp32_blocked_linear,
        "y = x @ w^T (+ bias), fp32, w in oneDNN's blocked layout of n_out / block blocks (blocked_linear_avx2.cpp)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("n_out"), pybind11::arg("block"),
        pybind11::arg("bias") = pybind11::none());
  m.def("mkldnn_weight_view", &mkldnn_weight_view,
        "an MKLDNN tensor [n_out, k_in] viewing w's bytes (not owning them), described by oneDNN's serialized md");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query token per sequence against its paged K/V blocks, fp32 (attention_avx2.cpp)");
  m.def("paged_decode_attention_q8", &paged_decode_attention_q8,
        "paged_decode_attention over 8-bit KV: int8 codes and fp32 per token-head scales read in place "
        "(attention_q8_avx2.cpp)");
  m.def("paged_decode_attention_mixed", &paged_decode_attention_mixed,
        "paged_decode_attention over block tables mixing fp32 and int8 blocks (is8 per block), each read in place "
        "in its own grid (attention_mixed_avx2.cpp)");
  m.def("prefill_attention_", &prefill_attention_,
        "causal attention of n query tokens, the last n of k/v's L, written into out, fp32 (attention_avx2.cpp)");
  m.def("rms_norm", &rms_norm, "Llama RMSNorm of fp32 rows: w * (x / sqrt(mean(x^2) + eps))");
  m.def("add_rms_norm_", &add_rms_norm_, "h += delta in place, then rms_norm(h, w, eps)");
  m.def("silu_mul", &silu_mul, "silu(gu[:, :I]) * gu[:, I:], as torch computes it (elementwise_avx2.cpp)");
  m.def("rope_kv_write_", &rope_kv_write_,
        "rotate q and k of a fused qkv row in place (RoPE), then copy its k and v rows into the KV storage");
  m.def("rope_kv_write_q8_", &rope_kv_write_q8_,
        "rope_kv_write_ into int8 KV blocks: each 8-bit token's k and v quantized (int8 codes, one fp32 scale per "
        "token and kv head) and replaced in qkv by what a read returns; fp32 tokens copied as rope_kv_write_ does");
}
