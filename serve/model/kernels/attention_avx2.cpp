// Decode attention straight over the paged KV blocks (fp32, AVX2 + FMA): one query token per sequence.
//
// Why: the torch path gathers every sequence's K and V blocks into dense [B, L, kv_heads, hd] temporaries
// (index_select) and then runs SDPA over them, so each step reads the KV cache, writes a copy and reads
// the copy again. Here each (sequence, kv head) task reads its K and V rows once, where they lie.
//
// Layout (serve/model/kv_cache.py): `blocks` is the storage viewed as [entries, block_size, kv_heads, hd];
// the K block of a sequence's j-th block in this layer is entry k_index[b, j] + layer (k_index: the layer-0
// entries, computed once per forward), its V block that entry + v_offset. The query heads of kv head h are h * group ... h * group + group - 1 (GQA, as HF).
//
// Math per query head: s_t = scale * q . k_t for t < len, p = softmax(s), out = sum_t p_t v_t, in fp32
// (scores kept per task, max subtracted before exp): the same function as SDPA, summed in another order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int kMaxGroup = 16;  // query heads per kv head handled per task

// One (sequence, kv head): `q` points at the group's G query rows (G * hd floats), `out` likewise; `layer`
// is added to every entry of `kidx`.
void attend(const float* q, float* out, const float* blocks, const int64_t* kidx, int64_t layer, int64_t v_offset, int64_t len,
            int64_t bs, int64_t row_stride, int64_t hd, int64_t G, float scale, std::vector<float>& scores) {
  scores.assign(static_cast<size_t>(G * len), 0.0f);
  const int64_t vecs = hd / 8;
  for (int64_t t = 0; t < len; ++t) {
    const float* k = blocks + ((kidx[t / bs] + layer) * bs + t % bs) * row_stride;
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < vecs; ++j)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * hd + 8 * j), _mm256_loadu_ps(k + 8 * j), acc);
      scores[g * len + t] = hsum(acc) * scale;
    }
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * len;
    const float m = *std::max_element(s, s + len);
    float sum = 0.0f;
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    inv[g] = 1.0f / sum;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < hd; ++j) out[g * hd + j] = 0.0f;
  // out_g += p_gt * v_t, four vectors (32 lanes) of the head at a time for every query of the group
  for (int64_t j0 = 0; j0 < vecs; j0 += 4) {
    const int64_t nv = std::min<int64_t>(4, vecs - j0);
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      const float* p = scores.data() + g * len;
      for (int64_t t = 0; t < len; ++t) {
        const float* v = blocks + ((kidx[t / bs] + layer + v_offset) * bs + t % bs) * row_stride + 8 * j0;
        const __m256 pt = _mm256_set1_ps(p[t]);
        for (int64_t j = 0; j < nv; ++j) acc[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * j), acc[j]);
      }
      const __m256 norm = _mm256_set1_ps(inv[g]);
      for (int64_t j = 0; j < nv; ++j) _mm256_storeu_ps(out + g * hd + 8 * (j0 + j), _mm256_mul_ps(acc[j], norm));
    }
  }
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& blocks, const torch::Tensor& k_index,
                                     int64_t layer, int64_t v_offset, const torch::Tensor& lens, double scale) {
  TORCH_CHECK(blocks.dim() == 4 && blocks.scalar_type() == torch::kFloat32 && blocks.is_contiguous() &&
                  blocks.device().is_cpu(), "blocks must be a contiguous fp32 CPU tensor [entries, block_size, kv_heads, hd]");
  const int64_t bs = blocks.size(1), kvh = blocks.size(2), hd = blocks.size(3);
  TORCH_CHECK(hd % 8 == 0, "head_dim must be a multiple of 8, got ", hd);
  const int64_t B = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.size(1) % (kvh * hd) == 0,
              "q must be a contiguous fp32 tensor [B, heads * head_dim]");
  const int64_t G = q.size(1) / (kvh * hd);
  TORCH_CHECK(G >= 1 && G <= kMaxGroup, "query heads per kv head must be 1..", kMaxGroup);
  TORCH_CHECK(k_index.dim() == 2 && k_index.size(0) == B && k_index.scalar_type() == torch::kLong &&
                  k_index.is_contiguous(), "k_index must be a contiguous int64 tensor [B, blocks]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == torch::kLong && lens.is_contiguous(),
              "lens must be a contiguous int64 tensor [B]");
  const int64_t nb = k_index.size(1), entries = blocks.size(0);
  const int64_t* kp = k_index.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * bs, "lens[", b, "] = ", lp[b], " outside 1..", nb * bs);
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(kp[b * nb + j] + layer >= 0 && kp[b * nb + j] + layer + v_offset < entries &&
                  kp[b * nb + j] + layer + v_offset >= 0, "k_index[", b, ", ", j, "] + layer out of range");
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* bp = blocks.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * kvh, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / kvh, h = task % kvh;
      const int64_t off = b * q.size(1) + h * G * hd;
      attend(qp + off, op + off, bp + h * hd, kp + b * nb, layer, v_offset, lp[b], bs, kvh * hd, hd, G, sc, scores);
    }
  });
  return out;
}
