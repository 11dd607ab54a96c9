// The AVX-512 variant's Python module (F / BW / VL + VNNI; serve/model/kernels/isa.py builds it with those flags,
// apart from the AVX2 baseline, and probes it in a child process before any kernel of it runs here). It holds only
// the ops it has a faster form of; every other op comes from the baseline module (kernels/__init__.py).
#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

// The decode attention kernels, their sources compiled again with this module's flags (attention_common.h's P.V
// on 16-lane vectors); hidden visibility keeps them apart from the baseline module's functions of the same names.
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

namespace avx512 {
torch::Tensor int8_linear_q8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales);
torch::Tensor int4_linear_q8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz, int64_t group);
torch::Tensor fp32_blocked_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n_out, int64_t block,
                                  const c10::optional<torch::Tensor>& bias);

// Executes one instruction of each extension the variant is compiled for and returns what they computed (the
// probe's child compares it with the expected value): F (16-wide FMA), BW (byte-masked load), VL + VNNI (256- and
// 512-bit vpdpbusd). A CPU or hypervisor that lists a flag but traps the instruction kills the child with SIGILL.
int64_t probe() {
  alignas(64) uint8_t u[64];
  alignas(64) int8_t s[64];
  for (int i = 0; i < 64; ++i) {
    u[i] = static_cast<uint8_t>(i + 1);
    s[i] = static_cast<int8_t>(i % 2 == 0 ? 1 : -2);
  }
  const __m512i uz = _mm512_maskz_loadu_epi8(~0ULL, u), sz = _mm512_maskz_loadu_epi8(~0ULL, s);
  const __m512i dz = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uz, sz);
  const __m256i dy = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm512_castsi512_si256(uz),
                                         _mm512_castsi512_si256(sz));
  const __m512 f = _mm512_fmadd_ps(_mm512_set1_ps(1.5f), _mm512_set1_ps(2.0f), _mm512_set1_ps(0.25f));
  alignas(64) int32_t iz[16];
  alignas(32) int32_t iy[8];
  _mm512_store_si512(iz, dz);
  _mm256_store_si256(reinterpret_cast<__m256i*>(iy), dy);
  int64_t total = static_cast<int64_t>(_mm512_reduce_add_ps(f) * 4.0f);  // 16 * 3.25 * 4 = 208
  for (int i = 0; i < 16; ++i) total += iz[i];
  for (int i = 0; i < 8; ++i) total += iy[i];
  return total;
}
}  // namespace avx512

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear_q8", &avx512::int8_linear_q8, "int8_linear_q8 with VNNI dot products (q8act_avx512.cpp)");
  m.def("int4_linear_q8", &avx512::int4_linear_q8, "int4_linear_q8 with VNNI dot products (q8act_avx512.cpp)");
  m.def("fp32_blocked_linear", &avx512::fp32_blocked_linear,
        "fp32_blocked_linear with 16-wide vectors (blocked_linear_avx512.cpp)", pybind11::arg("x"), pybind11::arg("w"),
        pybind11::arg("n_out"), pybind11::arg("block"), pybind11::arg("bias") = pybind11::none());
  m.def("paged_decode_attention", &paged_decode_attention, "paged_decode_attention, P.V on 16-lane vectors");
  m.def("paged_decode_attention_q8", &paged_decode_attention_q8, "paged_decode_attention_q8, P.V on 16-lane vectors");
  m.def("paged_decode_attention_mixed", &paged_decode_attention_mixed,
        "paged_decode_attention_mixed, P.V on 16-lane vectors");
  m.def("probe", &avx512::probe, "execute one instruction of each ISA extension this module uses; returns a checksum");
}
