// The per-layer elementwise steps between the projections, fused (fp32, AVX2): SwiGLU, and RoPE with the
// KV-cache write that follows it (fp32 rows, or int8 codes with their scales for 8-bit blocks).
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
#include <cmath>
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

namespace {

struct RopeShape {
  int64_t T, W, hd, row;  // tokens, qkv row width, head_dim, one token's k (or v) floats: kv_heads * hd
};

// The fused qkv rows [T, (heads + 2 * kv_heads) * hd] and their RoPE tables [T, hd], checked (both RoPE writes).
RopeShape check_rope_operands(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                              int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous() && qkv.device().is_cpu(),
              "qkv must be a contiguous fp32 CPU tensor [T, (heads + 2 * kv_heads) * head_dim]");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "qkv width ", qkv.size(1), " is not (heads + 2 * kv_heads) * head_dim");
  const int64_t T = qkv.size(0), W = qkv.size(1), hd = W / (heads + 2 * kv_heads), row = kv_heads * hd;
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even, got ", hd);
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == hd && t->scalar_type() == torch::kFloat32 &&
                    t->is_contiguous(), "cos and sin must be contiguous fp32 tensors [", T, ", ", hd, "]");
  return {T, W, hd, row};
}

}  // namespace

// qkv [T, (H + 2 * KVH) * hd] (q heads, k heads, v heads per row): q and k rotated in place by the RoPE tables
// cos / sin [T, hd] (each row's position already looked up); then each row's k and v (KVH * hd floats each) are
// copied to the KV storage (viewed as rows of KVH * hd floats) at row k_rows[t] + layer_offset and that plus v_offset.
void rope_kv_write_(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                    int64_t kv_heads, const torch::Tensor& storage, const torch::Tensor& k_rows, int64_t layer_offset,
                    int64_t v_offset) {
  const RopeShape shape = check_rope_operands(qkv, cos, sin, heads, kv_heads);
  const int64_t T = shape.T, W = shape.W, hd = shape.hd, row = shape.row;
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

namespace {

// One row of n floats as 8-bit KV (serve/model/kv_format.py quantize, int8): scale = absmax / 127, codes =
// round-half-even(x * (1 / scale)) clamped to +-127 (0 when the row is all zero); x becomes what a read returns,
// codes * scale. Each operation is one IEEE fp32 op in torch's order, so codes, scale and values equal torch's.
inline void quantize_row(float* x, int8_t* codes, float* scale, int64_t n) {
  float amax = 0.0f;
  for (int64_t d = 0; d < n; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float s = amax / 127.0f;
  const float inv = s > 0.0f ? 1.0f / s : 0.0f;
  for (int64_t d = 0; d < n; ++d) {
    const float y = std::min(127.0f, std::max(-127.0f, std::nearbyint(rounded(x[d] * inv))));
    codes[d] = static_cast<int8_t>(y);
    x[d] = static_cast<float>(codes[d]) * s;
  }
  *scale = s;
}

}  // namespace

// rope_kv_write_ for a cache holding int8 blocks (the KV-precision rung's mixed cache, or a static int8 one): q and
// k rotated in place as there; then each token t whose is8[t] is set (every token when is8 is empty) has each kv
// head of its k and v quantized (quantize_row) into the int8 code rows codes[k_rows[t] + layer_offset] (V:
// + v_offset) with its scale at scales[scale_rows[t] + layer_offset] (V: + v_offset), and its k and v in qkv
// replaced by their dequantized values (what attention over the fresh tokens must use); the other tokens' k and v
// are copied as fp32 into storage at k_rows[t] + layer_offset (V: + v_offset), as rope_kv_write_ does.
void rope_kv_write_q8_(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                       int64_t kv_heads, const torch::Tensor& storage, const torch::Tensor& codes,
                       const torch::Tensor& scales, const torch::Tensor& k_rows, const torch::Tensor& scale_rows,
                       const torch::Tensor& is8, int64_t layer_offset, int64_t v_offset) {
  const RopeShape shape = check_rope_operands(qkv, cos, sin, heads, kv_heads);
  const int64_t T = shape.T, W = shape.W, hd = shape.hd, row = shape.row;
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.device().is_cpu() &&
                  codes.numel() % row == 0, "codes must be contiguous int8 CPU rows of ", row, " bytes");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.device().is_cpu() &&
                  scales.numel() % kv_heads == 0, "scales must be contiguous fp32 CPU rows of ", kv_heads, " floats");
  TORCH_CHECK(storage.numel() == 0 || (storage.scalar_type() == torch::kFloat32 && storage.is_contiguous() &&
                                       storage.device().is_cpu() && storage.numel() % row == 0),
              "storage must be contiguous fp32 CPU rows of ", row, " floats (or empty: every token 8-bit)");
  for (const auto* t : {&k_rows, &scale_rows})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == T && t->scalar_type() == torch::kLong && t->is_contiguous(),
                "k_rows and scale_rows must be contiguous int64 tensors [", T, "]");
  TORCH_CHECK(is8.numel() == 0 || (is8.dim() == 1 && is8.size(0) == T && is8.is_contiguous() &&
                                   (is8.scalar_type() == torch::kUInt8 || is8.scalar_type() == torch::kBool)),
              "is8 must be a contiguous uint8 / bool tensor [", T, "] (or empty: every token 8-bit)");
  const int64_t code_rows = codes.numel() / row, scale_rows_n = scales.numel() / kv_heads;
  const int64_t full_rows = storage.numel() / row;
  const int64_t* kr = k_rows.data_ptr<int64_t>();
  const int64_t* sr = scale_rows.data_ptr<int64_t>();
  const uint8_t* e8 = is8.numel() ? static_cast<const uint8_t*>(is8.data_ptr()) : nullptr;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = kr[t] + layer_offset;
    const bool q = e8 == nullptr || e8[t] != 0;
    const int64_t limit = q ? code_rows : full_rows;
    TORCH_CHECK(r >= 0 && r + v_offset >= 0 && r < limit && r + v_offset < limit, "KV row of token ", t,
                " out of range");
    if (q) {
      const int64_t s = sr[t] + layer_offset;
      TORCH_CHECK(s >= 0 && s + v_offset >= 0 && s < scale_rows_n && s + v_offset < scale_rows_n,
                  "KV scale row of token ", t, " out of range");
    }
  }
  float* x = qkv.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* kv = storage.numel() ? storage.data_ptr<float>() : nullptr;
  int8_t* cd = codes.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(W), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = x + t * W;
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate_head(xr + h * hd, c + t * hd, s + t * hd, hd);
      const int64_t r = kr[t] + layer_offset;
      float* k = xr + heads * hd;
      float* v = xr + (heads + kv_heads) * hd;
      if (e8 != nullptr && e8[t] == 0) {
        std::memcpy(kv + r * row, k, sizeof(float) * row);
        std::memcpy(kv + (r + v_offset) * row, v, sizeof(float) * row);
        continue;
      }
      const int64_t sidx = sr[t] + layer_offset;
      for (int64_t h = 0; h < kv_heads; ++h) {
        quantize_row(k + h * hd, cd + r * row + h * hd, sc + sidx * kv_heads + h, hd);
        quantize_row(v + h * hd, cd + (r + v_offset) * row + h * hd, sc + (sidx + v_offset) * kv_heads + h, hd);
      }
    }
  });
}
