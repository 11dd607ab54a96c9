// Decode attention straight over 8-bit paged KV blocks (int8 codes + fp32 scales, AVX2 + FMA): one query token
// per sequence, the int8 twin of paged_decode_attention (attention_avx2.cpp).
//
// Why: at long context decode attention is a read of the whole KV cache; int8 codes are a quarter of fp32's bytes,
// so reading them in place (and dequantizing in registers) reads ~4x fewer bytes than the fp32 kernel, where a
// dequantize-then-attend path would write and read an fp32 copy as well.
//
// Layout (serve/model/kv_format.py, serve/model/kv_cache.py): `codes` is the arena viewed as int8
// [entries, block_size, kv_heads, hd], `scales` as fp32 [scale entries, block_size, kv_heads]; the K codes of a
// sequence's j-th block in this layer are entry k_index[b, j] + layer, its V codes that entry + v_offset, and
// their scales entries s_index[b, j] + layer and + v_offset of `scales`. A value is code * scale (one scale per
// token and kv head).
//
// Math per query head, the fp32 kernel's with the scales folded in where they cost least: the score of token t
// is scale * ks_t * (q . code_t) (one multiply per token, not per element), and the weights p_t are multiplied by
// vs_t before P.V over the codes. Eight K rows are converted to fp32 once for all query heads of the group.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "attention_common.h"
#include "avx2_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kMaxGroupQ8 = 16;  // query heads per kv head handled per task

struct ScratchQ8 {
  std::vector<float> scores;          // [G, lenp]: scaled scores, then their exps times V's scales
  std::vector<const int8_t*> krow;    // [lenp]: each token's K codes of this kv head (padding repeats row 0)
  std::vector<const int8_t*> vrow;    // [len]
  std::vector<float> ks;              // [lenp]: each token's K scale (0 past len)
  std::vector<float> vs;              // [lenp]: each token's V scale (0 past len)
  std::vector<float> tile;            // [8, hd]: eight K rows converted to fp32 (codes, unscaled)
};

// One (sequence, kv head): `q` points at the group's G query rows, `out` likewise; `codes` / `scales` at this kv
// head's first code / scale; `layer` is added to every entry of `kidx` and `sidx`.
void attend_q8(const float* q, float* out, const int8_t* codes, const float* scales, const int64_t* kidx,
               const int64_t* sidx, int64_t layer, int64_t v_offset, int64_t len, int64_t bs, int64_t kvh, int64_t hd,
               int64_t G, float scale, ScratchQ8& sc) {
  const int64_t lenp = (len + 7) & ~int64_t{7};
  const int64_t row_stride = kvh * hd;
  sc.scores.resize(static_cast<size_t>(G * lenp));
  sc.krow.resize(static_cast<size_t>(lenp));
  sc.vrow.resize(static_cast<size_t>(len));
  sc.ks.assign(static_cast<size_t>(lenp), 0.0f);
  sc.vs.assign(static_cast<size_t>(lenp), 0.0f);
  sc.tile.resize(static_cast<size_t>(8 * hd));
  for (int64_t t = 0; t < len; ++t) {
    const int64_t row = (kidx[t / bs] + layer) * bs + t % bs, srow = (sidx[t / bs] + layer) * bs + t % bs;
    sc.krow[t] = codes + row * row_stride;
    sc.vrow[t] = codes + (row + v_offset * bs) * row_stride;
    sc.ks[t] = scales[srow * kvh];
    sc.vs[t] = scales[(srow + v_offset * bs) * kvh];
  }
  for (int64_t t = len; t < lenp; ++t) sc.krow[t] = sc.krow[0];
  prefetch_rows(sc.krow.data(), sc.vrow.data(), len, hd);  // K first, as the fp32 kernel does (a row is hd bytes)
  float* scores = sc.scores.data();
  float* tile = sc.tile.data();
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < lenp; t0 += 8) {
    const float* k[8];
    for (int i = 0; i < 8; ++i) k[i] = widen_row(sc.krow[t0 + i], tile + i * hd, hd);
    const __m256 kscale = _mm256_mul_ps(vscale, _mm256_loadu_ps(sc.ks.data() + t0));
    score8(q, k, G, hd, kscale, pad_lanes(t0, len), scores + t0, lenp);
  }
  float inv[kMaxGroupQ8];
  softmax_heads(scores, lenp, len, G, sc.vs.data(), inv);  // p_t * vs_t (zero past len on both sides)
  weighted_heads(scores, lenp, len, sc.vrow.data(), inv, out, G, hd);  // V's scales are in the weights
}

void check_index(const torch::Tensor& index, const char* name, int64_t B) {
  TORCH_CHECK(index.dim() == 2 && index.size(0) == B && index.scalar_type() == torch::kLong && index.is_contiguous(),
              name, " must be a contiguous int64 tensor [B, blocks]");
}

}  // namespace

torch::Tensor paged_decode_attention_q8(const torch::Tensor& q, const torch::Tensor& codes, const torch::Tensor& scales,
                                        const torch::Tensor& k_index, const torch::Tensor& s_index, int64_t layer,
                                        int64_t v_offset, const torch::Tensor& lens, double scale) {
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.device().is_cpu(),
              "codes must be a contiguous int8 CPU tensor [entries, block_size, kv_heads, hd]");
  const int64_t bs = codes.size(1), kvh = codes.size(2), hd = codes.size(3);
  TORCH_CHECK(hd % 8 == 0, "head_dim must be a multiple of 8, got ", hd);
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.device().is_cpu() && scales.size(1) == bs && scales.size(2) == kvh,
              "scales must be a contiguous fp32 CPU tensor [entries, block_size, kv_heads]");
  const int64_t B = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.size(1) % (kvh * hd) == 0,
              "q must be a contiguous fp32 tensor [B, heads * head_dim]");
  const int64_t G = q.size(1) / (kvh * hd);
  TORCH_CHECK(G >= 1 && G <= kMaxGroupQ8, "query heads per kv head must be 1..", kMaxGroupQ8);
  check_index(k_index, "k_index", B);
  check_index(s_index, "s_index", B);
  TORCH_CHECK(s_index.size(1) == k_index.size(1), "k_index and s_index must have the same blocks");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == torch::kLong && lens.is_contiguous(),
              "lens must be a contiguous int64 tensor [B]");
  const int64_t nb = k_index.size(1), entries = codes.size(0), s_entries = scales.size(0);
  const int64_t* kp = k_index.data_ptr<int64_t>();
  const int64_t* sp = s_index.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * bs, "lens[", b, "] = ", lp[b], " outside 1..", nb * bs);
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j) {
      const int64_t k = kp[b * nb + j] + layer, s = sp[b * nb + j] + layer;
      TORCH_CHECK(k >= 0 && k + v_offset >= 0 && k + v_offset < entries && k < entries, "k_index[", b, ", ", j,
                  "] + layer out of range");
      TORCH_CHECK(s >= 0 && s + v_offset >= 0 && s + v_offset < s_entries && s < s_entries, "s_index[", b, ", ", j,
                  "] + layer out of range");
    }
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* scp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t grain = B >= 2 * at::get_num_threads() ? kvh : 1;  // as the fp32 kernel splits its tasks
  at::parallel_for(0, B * kvh, grain, [&](int64_t t0, int64_t t1) {
    ScratchQ8 scratch;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / kvh, h = task % kvh;
      const int64_t off = b * q.size(1) + h * G * hd;
      attend_q8(qp + off, op + off, cp + h * hd, scp + h, kp + b * nb, sp + b * nb, layer, v_offset, lp[b], bs, kvh,
                hd, G, sc, scratch);
    }
  });
  return out;
}
