// Small AVX2 helpers shared by the kernel sources (staged and hashed with them by kernels/__init__.py).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// bf16 -> fp32 is exact: the bf16 bits are the high half of the fp32 bits.
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The sum of the 8 lanes of v.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
