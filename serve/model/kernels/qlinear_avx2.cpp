// Weight-only int8 / int4 linear kernels for x86 CPUs with AVX2 + FMA (AVX-512 machines run them too).
//
// y[M, N] = x[M, K] @ W^T with fp32 activations and fp32 accumulation; the integer weights and bf16 scales
// are the ones serve/model/quantized_linear.py stores, read as they are (bf16 -> fp32 is exact):
//   int8: W[n, k] = q[n, k] * scale[n]                      (q int8 [N, K], scale bf16 [N])
//   int4: W[n, k] = (c[n, k] - 8) * s[g, n] + z[g, n]        (c in 0..15, g = k / group, sz bf16 [K/g, N, 2])
//   int8 blocks: W[n, k] = q[n, k] * d[n, k / 32]             (q int8 [N, K], d fp32 [N, K/32]: GGUF Q8_0)
// int4 codes are in the "blocked" layout (int4_pack in kernels/__init__.py): per row, each run of 32
// inputs is 16 bytes, byte j = c[32b + j] | c[32b + 16 + j] << 4, so one 16-byte load gives two runs of
// 16 consecutive codes with one mask and one shift.
//
// Order of operations (why results differ from dequantize-then-matmul only by fp32 rounding): per int4
// group, sum_k (c - 8) * x is accumulated in fp32 and multiplied by s once, z * sum_k x is added per group;
// int8 rows multiply the fp32 dot product by scale[n] once.
//
// Work is split over output rows with at::parallel_for (torch's intra-op threads). Each row is read once
// per tile of up to 4 activation rows, so small batches (decode) reuse the weight bytes from L1.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2_common.h"

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 4;  // activation rows per pass over a weight row

inline __m256 i8x8_to_ps(__m128i v) {  // the low 8 signed bytes of v -> 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

// ----------------------------------------------------------------------------------------------- int8

// FMA latency (4-5 cycles) would bound a single accumulator chain, so each activation row gets P = 4 / T
// independent partial sums: T * P = 4 chains in flight whatever the tile.
template <int T>
void int8_rows(const float* x, int64_t K, const int8_t* w, const uint16_t* scales, float* y, int64_t N,
               int64_t n0, int64_t n1) {
  constexpr int P = 4 / T;
  const int64_t K32 = K & ~int64_t(31), K16 = K & ~int64_t(15);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    __m256 acc[T][P];
    for (int t = 0; t < T; ++t)
      for (int p = 0; p < P; ++p) acc[t][p] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K32; k += 32) {
      __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
      __m128i qb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k + 16));
      __m256 wv[4] = {i8x8_to_ps(qa), i8x8_to_ps(_mm_srli_si128(qa, 8)), i8x8_to_ps(qb),
                      i8x8_to_ps(_mm_srli_si128(qb, 8))};
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < 4; ++j)
          acc[t][j % P] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + t * K + k + 8 * j), acc[t][j % P]);
    }
    for (int64_t k = K32; k < K16; k += 16) {
      __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k));
      __m256 w0 = i8x8_to_ps(q), w1 = i8x8_to_ps(_mm_srli_si128(q, 8));
      for (int t = 0; t < T; ++t) {
        acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * K + k), acc[t][0]);
        acc[t][P - 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * K + k + 8), acc[t][P - 1]);
      }
    }
    const float s = bf16_to_float(scales[n]);
    for (int t = 0; t < T; ++t) {
      __m256 sum = acc[t][0];
      for (int p = 1; p < P; ++p) sum = _mm256_add_ps(sum, acc[t][p]);
      float dot = hsum(sum);
      for (int64_t k = K16; k < K; ++k) dot += static_cast<float>(wr[k]) * x[t * K + k];
      y[t * N + n] = dot * s;
    }
  }
}

template <int T>
void int8_tile(const float* x, int64_t K, const int8_t* w, const uint16_t* s, float* y, int64_t N, int64_t n0,
               int64_t n1, int64_t rows) {
  if (rows == T) return int8_rows<T>(x, K, w, s, y, N, n0, n1);
  if constexpr (T > 1) int8_tile<T - 1>(x, K, w, s, y, N, n0, n1, rows);
}

// ----------------------------------------------------------------------------------------------- int4

inline float group_sum(const float* x, int64_t n) {  // sum of n (a multiple of 8) floats
  __m256 a = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(x + k));
  return hsum(a);
}

template <int T>
void int4_rows(const float* x, int64_t K, const uint8_t* packed, const uint16_t* sz, int64_t group, float* y,
               int64_t N, int64_t n0, int64_t n1) {
  constexpr int P = 4 / T;  // partial sums per activation row (see int8_rows)
  const int64_t G = K / group;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i eight = _mm_set1_epi8(8);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = packed + n * (K / 2);
    __m256 acc[T];
    float zacc[T];
    for (int t = 0; t < T; ++t) { acc[t] = _mm256_setzero_ps(); zacc[t] = 0.f; }
    for (int64_t g = 0; g < G; ++g) {
      __m256 gacc[T][P];
      for (int t = 0; t < T; ++t)
        for (int p = 0; p < P; ++p) gacc[t][p] = _mm256_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
        __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + k / 2));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low4), eight);                     // k .. k+15
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low4), eight);  // k+16 .. k+31
        __m256 wv[4] = {i8x8_to_ps(lo), i8x8_to_ps(_mm_srli_si128(lo, 8)), i8x8_to_ps(hi),
                        i8x8_to_ps(_mm_srli_si128(hi, 8))};
        for (int t = 0; t < T; ++t)
          for (int j = 0; j < 4; ++j)
            gacc[t][j % P] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + t * K + k + 8 * j), gacc[t][j % P]);
      }
      const uint16_t* szg = sz + (g * N + n) * 2;
      const __m256 s = _mm256_set1_ps(bf16_to_float(szg[0]));
      const float z = bf16_to_float(szg[1]);
      for (int t = 0; t < T; ++t) {
        __m256 gsum = gacc[t][0];
        for (int p = 1; p < P; ++p) gsum = _mm256_add_ps(gsum, gacc[t][p]);
        acc[t] = _mm256_fmadd_ps(gsum, s, acc[t]);
      }
      if (z != 0.f)  // asymmetric groups only (modelopt AWQ and our RTN are symmetric: z == 0)
        for (int t = 0; t < T; ++t) zacc[t] += z * group_sum(x + t * K + g * group, group);
    }
    for (int t = 0; t < T; ++t) y[t * N + n] = hsum(acc[t]) + zacc[t];
  }
}

template <int T>
void int4_tile(const float* x, int64_t K, const uint8_t* p, const uint16_t* sz, int64_t group, float* y,
               int64_t N, int64_t n0, int64_t n1, int64_t rows) {
  if (rows == T) return int4_rows<T>(x, K, p, sz, group, y, N, n0, n1);
  if constexpr (T > 1) int4_tile<T - 1>(x, K, p, sz, group, y, N, n0, n1, rows);
}

// ------------------------------------------------------------------------------- int8 blocks of 32 (Q8_0)

// W[n, k] = q[n, k] * d[n, k / 32]: the layout of GGUF's Q8_0 tensors (the embedded model's token embedding,
// tied to its LM head). Per block, sum_j q_j * x_j is accumulated in fp32 and multiplied by d once.
template <int T>
void block8_rows(const float* x, int64_t K, const int8_t* q, const float* d, float* y, int64_t N, int64_t n0,
                 int64_t n1) {
  const int64_t B = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = q + n * K;
    const float* dr = d + n * B;
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const int8_t* wb = wr + 32 * b;
      __m256 wv[4];
      for (int j = 0; j < 4; ++j)
        wv[j] = i8x8_to_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + 8 * j)));
      const __m256 db = _mm256_broadcast_ss(dr + b);
      for (int t = 0; t < T; ++t) {  // two chains per block: FMA latency
        const float* xb = x + t * K + 32 * b;
        __m256 s0 = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xb));
        __m256 s1 = _mm256_mul_ps(wv[1], _mm256_loadu_ps(xb + 8));
        s0 = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xb + 16), s0);
        s1 = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xb + 24), s1);
        acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), db, acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) y[t * N + n] = hsum(acc[t]);
  }
}

template <int T>
void block8_tile(const float* x, int64_t K, const int8_t* q, const float* d, float* y, int64_t N, int64_t n0,
                 int64_t n1, int64_t rows) {
  if (rows == T) return block8_rows<T>(x, K, q, d, y, N, n0, n1);
  if constexpr (T > 1) block8_tile<T - 1>(x, K, q, d, y, N, n0, n1, rows);
}

// at::parallel_for (OpenMP) gives each thread one contiguous range of rows; the grain only stops it from
// splitting fewer than this many rows (rows of one int4 group share scale cache lines).
constexpr int64_t kGrainRows = 16;
constexpr int64_t kSubRows = 64;  // weight rows per sub-range every tile of activation rows reuses (for_tiles)

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous fp32 CPU tensor");
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous(), "w must be int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.is_contiguous() && scales.numel() == w.size(0),
              "scales must be bf16 [N]");
  const int64_t N = w.size(0), K = w.size(1), M = x.size(0);
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    for_tiles(M, kTile, n0, n1, kSubRows, [&](int64_t m, int64_t rows, int64_t a, int64_t b) {
      int8_tile<kTile>(xp + m * K, K, wp, sp, yp + m * N, N, a, b, rows);
    });
  });
  return y;
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& sz,
                          int64_t group) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed must be uint8 [N, K/2]");
  const int64_t N = packed.size(0), K = packed.size(1) * 2, M = x.size(0);
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.dim() == 3 &&
                  sz.size(0) == K / group && sz.size(1) == N && sz.size(2) == 2,
              "scale_and_zero must be bf16 [K/group, N, 2]");
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    for_tiles(M, kTile, n0, n1, kSubRows, [&](int64_t m, int64_t rows, int64_t a, int64_t b) {
      int4_tile<kTile>(xp + m * K, K, pp, szp, group, yp + m * N, N, a, b, rows);
    });
  });
  return y;
}

torch::Tensor int4_dequantize(const torch::Tensor& packed, const torch::Tensor& sz, int64_t group) {
  // fp32 [N, K] = (c - 8) * s + z (multiply, then add: bit-identical to the torch formula), for large
  // batches (dequantize once, then one GEMM).
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && group % 32 == 0 && K % group == 0,
              "packed must be contiguous uint8 [N, K/2], group a multiple of 32 dividing K");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.size(0) == K / group &&
                  sz.size(1) == N, "scale_and_zero must be bf16 [K/group, N, 2]");
  auto w = torch::empty({N, K}, torch::kFloat32);
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  float* wp = w.data_ptr<float>();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i eight = _mm_set1_epi8(8);
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t k = 0; k < K; k += 32) {
        const uint16_t* szg = szp + ((k / group) * N + n) * 2;
        const __m256 s = _mm256_set1_ps(bf16_to_float(szg[0]));
        const __m256 z = _mm256_set1_ps(bf16_to_float(szg[1]));
        __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(pp + n * (K / 2) + k / 2));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(q, low4), eight);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), low4), eight);
        float* out = wp + n * K + k;
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(i8x8_to_ps(lo), s), z));
        _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(lo, 8)), s), z));
        _mm256_storeu_ps(out + 16, _mm256_add_ps(_mm256_mul_ps(i8x8_to_ps(hi), s), z));
        _mm256_storeu_ps(out + 24, _mm256_add_ps(_mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(hi, 8)), s), z));
      }
    }
  });
  return w;
}

torch::Tensor int8_block_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.size(1) % 32 == 0,
              "q must be contiguous int8 [N, K] with K a multiple of 32");
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  TORCH_CHECK(d.scalar_type() == torch::kFloat32 && d.is_contiguous() && d.dim() == 2 && d.size(0) == N &&
                  d.size(1) == K / 32, "d must be contiguous fp32 [N, K/32]");
  check_x(x, K);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    for_tiles(M, kTile, n0, n1, kSubRows, [&](int64_t m, int64_t rows, int64_t a, int64_t b) {
      block8_tile<kTile>(xp + m * K, K, qp, dp, yp + m * N, N, a, b, rows);
    });
  });
  return y;
}
