// The int8-activation kernels of q8act_avx2.cpp (what they compute and why: its header), written once over an
// integer dot-product policy D and compiled per ISA (q8act_avx2.cpp: vpmaddubsw + vpmaddwd; q8act_avx512.cpp:
// AVX-512 VNNI vpdpbusd). Both give the same int32 lanes, so both variants' outputs are equal bit for bit; the
// scalar fp32 steps are written as explicit std::fma, since FP contraction differs between the two builds (the
// AVX-512 one vectorizes some of these loops, and a vectorized multiply-add is not contracted).
// Include it after <torch/extension.h>, <ATen/Parallel.h> and avx2_common.h (all of it has internal linkage).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;      // activation values per int8 block (one 256-bit register)
constexpr int kTile = 4;            // activation rows per pass over a weight row
constexpr int64_t kGrainRows = 16;  // at::parallel_for splits no finer than this many weight rows
constexpr int64_t kSubRows = 64;    // weight rows per sub-range every tile of activation rows reuses (for_tiles)

// The int8 blocks of M activation rows: q [M, K], d [M, K / 32] and each block's sum of q [M, K / 32].
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> qsum;
};

// One block of 32 floats -> 32 int8 (see the header for the rounding); returns the block's scale.
inline float quantize_block(const float* x, int8_t* q, int32_t* qsum) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float a = _mm_cvtss_f32(m);
  const float inv = a > 0.0f ? 127.0f / a : 0.0f;
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i r[4];
  for (int i = 0; i < 4; ++i)
    r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // int32 -> int16 -> int8 packs interleave 128-bit lanes; the permute restores k order
  __m256i p16a = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
  __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *qsum = _mm_cvtsi128_si32(s4);
  return a / 127.0f;
}

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t B = K / kBlock;
  Q8Rows out{std::vector<int8_t>(M * K), std::vector<float>(M * B), std::vector<int32_t>(M * B)};
  for (int64_t i = 0; i < M * B; ++i) out.d[i] = quantize_block(x + i * kBlock, out.q.data() + i * kBlock, &out.qsum[i]);
  return out;
}

// ----------------------------------------------------------------------------------------------- int4

// Codes of the blocked layout (qlinear_avx2.cpp): 16 bytes hold 32 codes, byte j = c[j] | c[16 + j] << 4.
inline __m256i int4_codes(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// T activation rows against weight rows [n0, n1). corr[t * G + g] = -8 * sum_{b in g} d_b * qsum_b and
// xsum[t * G + g] = sum_{k in g} x_k are per row and group, shared by every weight row.
// R weight rows [n, n + R) against T activation rows: each activation block is loaded once for R rows and each
// code block once for T rows. corr[t * G + g] = -8 * sum_{b in g} d_b * qsum_b and xsum[t * G + g] =
// sum_{k in g} x_k are per activation row and group, shared by every weight row.
template <class D, int T, int R>
inline void int4_block_rows(const int8_t* xq, const float* xd, int64_t K, int64_t B, const uint8_t* packed,
                            const uint16_t* sz, int64_t G, int64_t per_group, const float* corr, const float* xsum,
                            float* y, int64_t N, int64_t n) {
  // One accumulator per (row, row) pair and group: a group's chain is only group / 32 FMAs long and the next
  // group starts a fresh register, so out-of-order execution overlaps groups (accumulator arrays are only
  // indexed by compile-time constants: a runtime index would keep them in memory).
  __m256 acc[R][T];
  float extra[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) { acc[r][t] = _mm256_setzero_ps(); extra[r][t] = 0.0f; }
  for (int64_t g = 0; g < G; ++g) {
    __m256 gacc[R][T];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) gacc[r][t] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m256i c[R];
      for (int r = 0; r < R; ++r) c[r] = int4_codes(packed + (n + r) * (K / 2) + b * (kBlock / 2));
      for (int t = 0; t < T; ++t) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * K + b * kBlock));
        const __m256 d = _mm256_broadcast_ss(xd + t * B + b);
        for (int r = 0; r < R; ++r)
          gacc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(D::dot(c[r], q)), d, gacc[r][t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const uint16_t* szg = sz + (g * N + n + r) * 2;
      const float s = bf16_to_float(szg[0]), z = bf16_to_float(szg[1]);
      for (int t = 0; t < T; ++t) {
        acc[r][t] = _mm256_fmadd_ps(gacc[r][t], _mm256_set1_ps(s), acc[r][t]);
        // explicit fma: left to FP contraction, the AVX-512 build (vectorized otherwise) rounded differently
        extra[r][t] += std::fma(s, corr[t * G + g], z * xsum[t * G + g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[t * N + n + r] = hsum(acc[r][t]) + extra[r][t];
}

template <class D, int T>
void int4_rows(const Q8Rows& a, int64_t m, int64_t K, const uint8_t* packed, const uint16_t* sz, int64_t group,
               const float* corr, const float* xsum, float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int R = T <= 2 ? 2 : 1;  // few activation rows: share their loads over two weight rows
  const int64_t B = K / kBlock, G = K / group, per_group = group / kBlock;
  const int8_t* xq = a.q.data() + m * K;
  const float* xd = a.d.data() + m * B;
  int64_t n = n0;
  for (; n + R <= n1; n += R) int4_block_rows<D, T, R>(xq, xd, K, B, packed, sz, G, per_group, corr, xsum, y, N, n);
  for (; n < n1; ++n) int4_block_rows<D, T, 1>(xq, xd, K, B, packed, sz, G, per_group, corr, xsum, y, N, n);
}

// ----------------------------------------------------------------------------------------------- int8

// One block of int8 weights against T activation rows, accumulated into acc[t].
template <class D, int T>
inline void int8_block(const int8_t* wr, const int8_t* xq, const float* xd, int64_t K, int64_t B, int64_t b,
                       __m256 (&acc)[T]) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * kBlock));
  const __m256i wabs = _mm256_sign_epi8(wv, wv);  // |w| as unsigned bytes; the sign moves to q
  for (int t = 0; t < T; ++t) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + t * K + b * kBlock));
    const __m256 dot = _mm256_cvtepi32_ps(D::dot(wabs, _mm256_sign_epi8(q, wv)));
    acc[t] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(xd + t * B + b), acc[t]);
  }
}

template <class D, int T>
void int8_rows(const Q8Rows& a, int64_t m, int64_t K, const int8_t* w, const uint16_t* scales, float* y, int64_t N,
               int64_t n0, int64_t n1) {
  const int64_t B = K / kBlock;
  const int8_t* xq = a.q.data() + m * K;
  const float* xd = a.d.data() + m * B;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    __m256 even[T], odd[T];  // two chains per row: one FMA chain would wait on FMA latency at T = 1
    for (int t = 0; t < T; ++t) even[t] = odd[t] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < B; b += 2) {
      int8_block<D, T>(wr, xq, xd, K, B, b, even);
      int8_block<D, T>(wr, xq, xd, K, B, b + 1, odd);
    }
    if (b < B) int8_block<D, T>(wr, xq, xd, K, B, b, even);
    const float s = bf16_to_float(scales[n]);
    for (int t = 0; t < T; ++t) y[t * N + n] = hsum(_mm256_add_ps(even[t], odd[t])) * s;
  }
}

// Calls fn.template operator()<T>() with T = rows (1..kTile): the row count as a compile-time tile size.
template <int T, typename F>
void with_tile(int64_t rows, F&& fn) {
  if (rows == T) return fn(std::integral_constant<int, T>{});
  if constexpr (T > 1) with_tile<T - 1>(rows, fn);
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous fp32 CPU tensor");
  TORCH_CHECK(K % kBlock == 0, "in_features must be a multiple of ", kBlock, " for int8 activations");
}

inline std::tuple<torch::Tensor, torch::Tensor> q8_quantize_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_x(x, K);
  Q8Rows a = quantize_rows(x.data_ptr<float>(), M, K);
  auto q = torch::empty({M, K}, torch::kInt8);
  auto d = torch::empty({M, K / kBlock}, torch::kFloat32);
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * sizeof(float));
  return {q, d};
}

// int4_linear_q8 with the integer dot products of D (one per ISA: D::dot(u, s) = 8 int32 lanes, lane i the sum of
// u_j * s_j over bytes 4i .. 4i + 3, exactly).
template <class D>
torch::Tensor int4_q8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz, int64_t group) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed must be uint8 [N, K/2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2, M = x.size(0);
  TORCH_CHECK(group % kBlock == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 &&
                  sz.size(0) == K / group && sz.size(1) == N && sz.size(2) == 2,
              "scale_and_zero must be bf16 [K/group, N, 2]");
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const Q8Rows a = quantize_rows(xp, M, K);
  const int64_t B = K / kBlock, G = K / group, per_group = group / kBlock;
  std::vector<float> corr(M * G, 0.0f), xsum(M * G, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float c = 0.0f, s = 0.0f;
      for (int64_t j = 0; j < per_group; ++j) {
        const int64_t b = m * B + g * per_group + j;
        c = std::fma(a.d[b], static_cast<float>(a.qsum[b]), c);  // one rounding on every ISA (see extra above)
      }
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xp[m * K + k];
      corr[m * G + g] = -8.0f * c;
      xsum[m * G + g] = s;
    }
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    for_tiles(M, kTile, n0, n1, kSubRows, [&](int64_t m, int64_t rows, int64_t lo, int64_t hi) {
      with_tile<kTile>(rows, [&](auto tile) {
        int4_rows<D, decltype(tile)::value>(a, m, K, pp, szp, group, corr.data() + m * G, xsum.data() + m * G,
                                         yp + m * N, N, lo, hi);
      });
    });
  });
  return y;
}

template <class D>
torch::Tensor int8_q8(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w must be int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.is_contiguous() && scales.numel() == w.size(0),
              "scales must be bf16 [N]");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Q8Rows a = quantize_rows(x.data_ptr<float>(), M, K);
  const int8_t* wp = w.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    for_tiles(M, kTile, n0, n1, kSubRows, [&](int64_t m, int64_t rows, int64_t lo, int64_t hi) {
      with_tile<kTile>(rows, [&](auto tile) {
        int8_rows<D, decltype(tile)::value>(a, m, K, wp, sp, yp + m * N, N, lo, hi);
      });
    });
  });
  return y;
}

}  // namespace
