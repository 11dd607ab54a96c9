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

// Calls fn(m, rows, a, b) for every tile of up to `tile` activation rows (m: its first row, rows: how many) against
// weight rows [a, b), for consecutive sub-ranges [a, b) of [n0, n1) of `sub` weight rows: a sub-range is read from
// memory once and reused from cache by every tile (looping over the tiles outermost streamed the whole range once
// per tile: a verify or batched head of 20 rows read its weights five times). Each output's arithmetic is that of
// its tile alone, so results do not change.
template <typename F>
inline void for_tiles(int64_t M, int64_t tile, int64_t n0, int64_t n1, int64_t sub, F&& fn) {
  for (int64_t a = n0; a < n1; a += sub) {
    const int64_t b = a + sub < n1 ? a + sub : n1;
    for (int64_t m = 0; m < M; m += tile) fn(m, M - m < tile ? M - m : tile, a, b);
  }
}
