// AVX2 helpers of the attention kernels (attention_avx2.cpp: fp32 KV; attention_q8_avx2.cpp: 8-bit KV;
// attention_mixed_avx2.cpp: a block table mixing the two), staged and hashed with them by kernels/__init__.py. The
// decode kernels share their arithmetic through these, in one order, so the mixed kernel equals each single-format
// kernel bit for bit on a table of that format. The AVX-512 variant (serve/model/kernels/isa.py) compiles the three
// decode kernels again with its flags: their P.V (weighted_heads) then runs on 16-lane vectors, with the same bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "avx2_common.h"
#include "simd_f32.h"

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

// A K or V row of a table that mixes formats: fp32 values (f) or int8 codes (c), exactly one of them set.
struct MixedRow {
  const float* f;
  const int8_t* c;
};

// Every cache line of a row of hd values asked for (into L2): 16 fp32 values or 64 codes a line.
inline void prefetch_row(const float* row, int64_t hd) {
  for (int64_t d = 0; d < hd; d += 16) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T1);
}
inline void prefetch_row(const int8_t* row, int64_t hd) {
  for (int64_t d = 0; d < hd; d += 64) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T1);
}
inline void prefetch_row(const MixedRow& row, int64_t hd) {
  if (row.c != nullptr) prefetch_row(row.c, hd);
  else prefetch_row(row.f, hd);
}

// Every K row of a task, then every V row, asked for up front: the V lines arrive while the scores are computed.
template <typename Row>
void prefetch_rows(const Row* krow, const Row* vrow, int64_t len, int64_t hd) {
  for (int64_t t = 0; t < len; ++t) prefetch_row(krow[t], hd);
  for (int64_t t = 0; t < len; ++t) prefetch_row(vrow[t], hd);
}

// An int8 row's codes as fp32 in dst (unscaled: conversion is exact); returns dst.
inline const float* widen_row(const int8_t* codes, float* dst, int64_t hd) {
  for (int64_t j = 0; j < hd / 8; ++j) _mm256_storeu_ps(dst + 8 * j, load8_values(codes + 8 * j));
  return dst;
}

// scores[g * lenp + i] = kscale_i * (q_g . k_i) for eight fp32 K rows k[0..8) and the G query rows of q (hd apart),
// -inf in the lanes of `pad`: eight independent FMA chains per query head, reduced together.
inline void score8(const float* q, const float* const* k, int64_t G, int64_t hd, __m256 kscale, __m256 pad,
                   float* scores, int64_t lenp) {
  const int64_t vecs = hd / 8;
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < vecs; ++j) {
      const __m256 qv = _mm256_loadu_ps(q + g * hd + 8 * j);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[i] + 8 * j), acc[i]);
    }
    const __m256 s = _mm256_mul_ps(hsum8(acc), kscale);
    _mm256_storeu_ps(scores + g * lenp, _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), pad));
  }
}

// The lanes t0 + i >= len of a group of eight tokens (padding), as a blend mask.
inline __m256 pad_lanes(int64_t t0, int64_t len) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(len - t0 - 1))));
}

// Softmax of each query head's scores (inv[g]: 1 / its sum), then the weights times V's per-token scales `vs`
// (zero past len) when the rows are int8 codes; fp32 rows' weights stay as they are (a scale of 1).
inline void softmax_heads(float* scores, int64_t lenp, int64_t len, int64_t G, const float* vs, float* inv) {
  for (int64_t g = 0; g < G; ++g) {
    inv[g] = softmax_row(scores + g * lenp, len, len);
    if (vs == nullptr) continue;
    for (int64_t t = 0; t < lenp; t += 8)
      _mm256_storeu_ps(scores + g * lenp + t,
                       _mm256_mul_ps(_mm256_loadu_ps(scores + g * lenp + t), _mm256_loadu_ps(vs + t)));
  }
}

constexpr int kVecs = 4;  // vectors of the head dimension per P.V register tile

// S::kLanes values from element i of a V row as floats: fp32 rows as they are, int8 codes converted (their scale
// is in the weights), whatever the row's kind.
template <class S>
inline typename S::V load_at(const float* row, int64_t i) { return S::loadu(row + i); }
template <class S>
inline typename S::V load_at(const int8_t* row, int64_t i) { return S::widen(row + i); }
template <class S>
inline typename S::V load_at(const MixedRow& row, int64_t i) {
  return row.c != nullptr ? S::widen(row.c + i) : S::loadu(row.f + i);
}

// out[g] (g < GC) = inv[g] * sum_t p[g][t] * v_t over NV vectors of S (simd_f32.h) of the head from lane
// S::kLanes * j0: GC * NV accumulators stay in registers while every V row is read (and, for int8 codes,
// converted) once. Each output lane is one FMA chain over t whatever the vector width, so the AVX-512 variant's
// 16-lane tiles give the 8-lane tiles' bits.
template <class S, int GC, int NV, typename Row>
void weighted_rows(const float* p, int64_t lenp, int64_t len, const Row* vrow, int64_t j0, const float* inv,
                   float* out, int64_t hd) {
  constexpr int L = S::kLanes;
  typename S::V acc[GC][NV];
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = S::zero();
  for (int64_t t = 0; t < len; ++t) {
    typename S::V v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load_at<S>(vrow[t], L * (j0 + j));
    for (int g = 0; g < GC; ++g) {
      const typename S::V pt = S::broadcast(p + g * lenp + t);
      for (int j = 0; j < NV; ++j) acc[g][j] = S::fmadd(pt, v[j], acc[g][j]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int j = 0; j < NV; ++j) S::storeu(out + g * hd + L * (j0 + j), S::mul(acc[g][j], S::set1(inv[g])));
}

template <class S, int GC, typename Row>
void weighted_rows_any(const float* p, int64_t lenp, int64_t len, const Row* vrow, int64_t j0, int64_t nv,
                       const float* inv, float* out, int64_t hd) {
  switch (nv) {
    case 1: weighted_rows<S, GC, 1>(p, lenp, len, vrow, j0, inv, out, hd); break;
    case 2: weighted_rows<S, GC, 2>(p, lenp, len, vrow, j0, inv, out, hd); break;
    case 3: weighted_rows<S, GC, 3>(p, lenp, len, vrow, j0, inv, out, hd); break;
    default: weighted_rows<S, GC, kVecs>(p, lenp, len, vrow, j0, inv, out, hd); break;
  }
}

template <class S, typename Row>
void weighted_heads_with(const float* scores, int64_t lenp, int64_t len, const Row* vrow, const float* inv,
                         float* out, int64_t G, int64_t hd) {
  const int64_t vecs = hd / S::kLanes;
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int64_t gc = std::min<int64_t>(3, G - g0);
    for (int64_t j0 = 0; j0 < vecs; j0 += kVecs) {
      const int64_t nv = std::min<int64_t>(kVecs, vecs - j0);
      const float* p = scores + g0 * lenp;
      float* o = out + g0 * hd;
      if (gc == 3) weighted_rows_any<S, 3>(p, lenp, len, vrow, j0, nv, inv + g0, o, hd);
      else if (gc == 2) weighted_rows_any<S, 2>(p, lenp, len, vrow, j0, nv, inv + g0, o, hd);
      else weighted_rows_any<S, 1>(p, lenp, len, vrow, j0, nv, inv + g0, o, hd);
    }
  }
}

// out_g = inv_g * sum_t p_gt v_t for the G query heads of a kv head (`scores`: their weights, lenp apart): up to
// three query heads x four vectors of the head per register tile. A Row is a const float*, a const int8_t* or a
// MixedRow.
template <typename Row>
void weighted_heads(const float* scores, int64_t lenp, int64_t len, const Row* vrow, const float* inv, float* out,
                    int64_t G, int64_t hd) {
#ifdef __AVX512F__
  if (hd % 16 == 0) return weighted_heads_with<Avx512F>(scores, lenp, len, vrow, inv, out, G, hd);
#endif
  weighted_heads_with<Avx2F>(scores, lenp, len, vrow, inv, out, G, hd);
}
