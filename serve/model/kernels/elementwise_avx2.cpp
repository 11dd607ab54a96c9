// The per-layer elementwise steps between the projections, fused (fp32, AVX2): SwiGLU, and RoPE with the
// KV-cache write that follows it.
//
// Why: in torch they are ten small ops per layer (silu, mul; cat, neg, two muls, add; two index_copy_), each a
// pass over the activations with a temporary of its own; at 30 layers per step they were ~9 % of a 32-row
// decode step on the 2-core EPYC (py-spy). Here each is one pass.
//
// Exactness (tests/test_qkernels.py, torch.equal): RoPE is bit-identical to the torch ops it replaces: HF's
// x * cos + rotate_half(x) * sin with each product rounded before the sum, as torch's separate ops round them
// (no FMA contraction: see `rounded`). SiLU is torch's formula, x / (1 + exp(-x)), with the exp torch's vector
// loop uses (SLEEF's 1-ulp expf, exported by libtorch_cpu): bit-identical wherever torch vectorizes (widths that
// are a multiple of its vector length, as SmolLM2's 1536); torch's ragged tails use libm's expf (an ulp apart).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sleef.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGrainElems = 1 << 15;  // elements per thread at least: a small step runs without a fork

// A product the compiler may not fuse into a following add (GCC contracts vector mul + add into an FMA, whose
// single rounding would differ from torch's two).
inline __m256 rounded(__m256 p) {
  asm("" : "+x"(p));
  return p;
}

inline float rounded(float p) {
  asm("" : "+x"(p));
  return p;
}

inline __m256 silu(__m256 x) {
  const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline float silu(float x) {
  float v[8] = {x, 0, 0, 0, 0, 0, 0, 0};
  float r[8];
  _mm256_storeu_ps(r, silu(_mm256_loadu_ps(v)));
  return r[0];
}

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, width)); }

// One head of `hd` floats rotated in place: x[d] * cos[d] + rot[d] * sin[d], rot = (-x[half:], x[:half]).
inline void rotate_head(float* x, const float* c, const float* s, int64_t hd) {
  const int64_t half = hd / 2;
  int64_t d = 0;
  for (; d + 8 <= half; d += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + d), x2 = _mm256_loadu_ps(x + half + d);
    const __m256 a = _mm256_add_ps(rounded(_mm256_mul_ps(x1, _mm256_loadu_ps(c + d))),
                                   rounded(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), _mm256_loadu_ps(s + d))));
    const __m256 b = _mm256_add_ps(rounded(_mm256_mul_ps(x2, _mm256_loadu_ps(c + half + d))),
                                   rounded(_mm256_mul_ps(x1, _mm256_loadu_ps(s + half + d))));
    _mm256_storeu_ps(x + d, a);
    _mm256_storeu_ps(x + half + d, b);
  }
  for (; d < half; ++d) {
    const float x1 = x[d], x2 = x[half + d];
    x[d] = rounded(x1 * c[d]) + rounded(-x2 * s[d]);
    x[half + d] = rounded(x2 * c[half + d]) + rounded(x1 * s[half + d]);
  }
}

}  // namespace

// out[t, i] = silu(gu[t, i]) * gu[t, I + i] for gu [T, 2I] (the fused gate/up projection's output).
torch::Tensor silu_mul(const torch::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat32 && gu.is_contiguous() && gu.device().is_cpu() &&
                  gu.size(1) % 2 == 0, "gu must be a contiguous fp32 CPU tensor [T, 2 * intermediate]");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({T, I}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* gate = g + t * 2 * I;
      const float* up = gate + I;
      float* y = o + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(silu(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
      for (; i < I; ++i) y[i] = silu(gate[i]) * up[i];
    }
  });
  return out;
}

// qkv [T, (H + 2 * KVH) * hd] (q heads, k heads, v heads per row): q and k rotated in place by the RoPE tables
// cos / sin [T, hd] (each row's position already looked up); then each row's k and v (KVH * hd floats each) are
// copied to the KV storage (viewed as rows of KVH * hd floats) at row k_rows[t] + layer_offset and that plus v_offset.
void rope_kv_write_(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                    int64_t kv_heads, const torch::Tensor& storage, const torch::Tensor& k_rows, int64_t layer_offset,
                    int64_t v_offset) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous() && qkv.device().is_cpu(),
              "qkv must be a contiguous fp32 CPU tensor [T, (heads + 2 * kv_heads) * head_dim]");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "qkv width ", qkv.size(1), " is not (heads + 2 * kv_heads) * head_dim");
  const int64_t T = qkv.size(0), W = qkv.size(1), hd = W / (heads + 2 * kv_heads), row = kv_heads * hd;
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even, got ", hd);
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == hd && t->scalar_type() == torch::kFloat32 &&
                    t->is_contiguous(), "cos and sin must be contiguous fp32 tensors [", T, ", ", hd, "]");
  TORCH_CHECK(storage.scalar_type() == torch::kFloat32 && storage.is_contiguous() && storage.device().is_cpu() &&
                  storage.numel() % row == 0, "storage must be contiguous fp32 CPU rows of ", row, " floats");
  TORCH_CHECK(k_rows.dim() == 1 && k_rows.size(0) == T && k_rows.scalar_type() == torch::kLong && k_rows.is_contiguous(),
              "k_rows must be a contiguous int64 tensor [", T, "]");
  const int64_t rows = storage.numel() / row;
  const int64_t* kr = k_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = kr[t] + layer_offset;
    TORCH_CHECK(r >= 0 && r + v_offset >= 0 && r < rows && r + v_offset < rows, "KV row of token ", t, " out of range");
  }
  float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* kv = storage.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(W), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = x + t * W;
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate_head(xr + h * hd, c + t * hd, s + t * hd, hd);
      const int64_t r = kr[t] + layer_offset;
      std::memcpy(kv + r * row, xr + heads * hd, sizeof(float) * row);
      std::memcpy(kv + (r + v_offset) * row, xr + (heads + kv_heads) * hd, sizeof(float) * row);
    }
  });
}
