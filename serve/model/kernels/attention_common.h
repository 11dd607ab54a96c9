// AVX2 helpers of the attention kernels (attention_avx2.cpp: fp32 KV; attention_q8_avx2.cpp: 8-bit KV), staged and
// hashed with them by kernels/__init__.py.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "avx2_common.h"

// The eight lane sums of a[0..7], as one vector.
inline __m256 hsum8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(x) for x <= 0 (scores minus their max), Cephes' expf range reduction and polynomial (about 1e-7
// relative error); below -87 (and for the -inf padding) it returns 0, where expf gives at most 1.6e-38.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, x), x, x), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// s[0..len) := exp(s - max), then s[len..zero_to) := 0 (zero_to >= len); returns 1 / sum.
inline float softmax_row(float* s, int64_t len, int64_t zero_to) {
  const int64_t lenp = (len + 7) & ~int64_t{7};
  for (int64_t t = len; t < std::max(lenp, zero_to); ++t) s[t] = t < lenp ? -INFINITY : 0.0f;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < lenp; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const __m256 mx = _mm256_set1_ps(_mm_cvtss_f32(m4));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < lenp; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), mx));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return 1.0f / hsum(sum);
}

// Eight values of a V row as floats: fp32 rows as they are, int8 codes converted (their scale is in the weights).
inline __m256 load8_values(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_values(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

constexpr int kVecs = 4;  // 8-lane vectors of the head dimension per P.V register tile

// out[g] (g < GC) = inv[g] * sum_t p[g][t] * v_t over NV vectors of the head from lane 8 * j0: GC * NV
// accumulators stay in registers while every V row is read (and, for int8 codes, converted) once.
template <int GC, int NV, typename T>
void weighted_rows(const float* p, int64_t lenp, int64_t len, const T* const* vrow, int64_t j0, const float* inv,
                   float* out, int64_t hd) {
  __m256 acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    __m256 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load8_values(vrow[t] + 8 * (j0 + j));
    for (int g = 0; g < GC; ++g) {
      const __m256 pt = _mm256_broadcast_ss(p + g * lenp + t);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm256_fmadd_ps(pt, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j)
      _mm256_storeu_ps(out + g * hd + 8 * (j0 + j), _mm256_mul_ps(acc[g][j], _mm256_set1_ps(inv[g])));
}

template <int GC, typename T>
void weighted_rows_any(const float* p, int64_t lenp, int64_t len, const T* const* vrow, int64_t j0, int64_t nv,
                       const float* inv, float* out, int64_t hd) {
  switch (nv) {
    case 1: weighted_rows<GC, 1>(p, lenp, len, vrow, j0, inv, out, hd); break;
    case 2: weighted_rows<GC, 2>(p, lenp, len, vrow, j0, inv, out, hd); break;
    case 3: weighted_rows<GC, 3>(p, lenp, len, vrow, j0, inv, out, hd); break;
    default: weighted_rows<GC, kVecs>(p, lenp, len, vrow, j0, inv, out, hd); break;
  }
}

// out_g = inv_g * sum_t p_gt v_t for the G query heads of a kv head (`scores`: their weights, lenp apart): up to
// three query heads x four vectors of the head per register tile.
template <typename T>
void weighted_heads(const float* scores, int64_t lenp, int64_t len, const T* const* vrow, const float* inv, float* out,
                    int64_t G, int64_t hd) {
  const int64_t vecs = hd / 8;
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int64_t gc = std::min<int64_t>(3, G - g0);
    for (int64_t j0 = 0; j0 < vecs; j0 += kVecs) {
      const int64_t nv = std::min<int64_t>(kVecs, vecs - j0);
      const float* p = scores + g0 * lenp;
      float* o = out + g0 * hd;
      if (gc == 3) weighted_rows_any<3>(p, lenp, len, vrow, j0, nv, inv + g0, o, hd);
      else if (gc == 2) weighted_rows_any<2>(p, lenp, len, vrow, j0, nv, inv + g0, o, hd);
      else weighted_rows_any<1>(p, lenp, len, vrow, j0, nv, inv + g0, o, hd);
    }
  }
}
