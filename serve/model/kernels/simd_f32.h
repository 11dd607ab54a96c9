// fp32 vector traits the kernels written once for both ISAs are templated on: Avx2F (8 lanes, AVX2 + FMA) in every
// build, Avx512F (16 lanes) only in sources compiled with -mavx512f (the AVX-512 variant, serve/model/kernels/isa.py),
// so the baseline never contains an AVX-512 instruction. An FMA is one rounding whatever the width, so a lane's
// chain rounds exactly as the same chain in the other width: kernels whose every output is one lane's chain give
// the same bits on both variants.
#pragma once

#include <immintrin.h>

#include <cstdint>

struct Avx2F {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_load_ps(p); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_store_ps(p, v); }
  static void storeu(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  // 8 int8 codes as floats (exact)
  static V widen(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
};

#ifdef __AVX512F__
struct Avx512F {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_load_ps(p); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_store_ps(p, v); }
  static void storeu(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  // 16 int8 codes as floats (exact)
  static V widen(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
#endif
