// Decode attention over block tables that mix formats (AVX2 + FMA): one query token per sequence, each block read in
// place in its own format, fp32 K/V or int8 codes with fp32 per token-head scales.
//
// Why: the KV-precision rung (serve/engine/kv_rung.py) turns free full-precision slots into 8-bit blocks, so a running
// sequence's later blocks are 8-bit while its earlier ones are not. The single-format kernels (attention_avx2.cpp,
// attention_q8_avx2.cpp) cannot read such a table, and the dense path (gather, dequantize, SDPA) writes and reads an
// fp32 copy of every block of every layer at every step: with the KV rung on, a bursty replay's mean TPOT doubled.
//
// Layout (serve/model/kv_cache.py: the two BlockStores lie over the same arena bytes with different grids): `blocks`
// is the full-precision grid viewed as fp32 [entries, block_size, kv_heads, hd], `codes` the 8-bit grid as int8
// [entries, block_size, kv_heads, hd] and `scales` as fp32 [scale entries, block_size, kv_heads]. The j-th block of
// sequence b is 8-bit when is8[b, j] != 0: its K codes are entry k_index[b, j] + layer of `codes` and their scales
// entry s_index[b, j] + layer of `scales`; otherwise its K rows are entry k_index[b, j] + layer of `blocks` (s_index
// unused). V: those entries + v_offset, in either grid.
//
// Math: each token the way its format's kernel does it, through attention_common.h in the same order: an int8 token's
// score is scale * ks_t * (q . code_t) and its weight p_t * vs_t, an fp32 token's has ks_t = vs_t = 1 (exact). On a
// table of one format the output therefore equals that format's kernel bit for bit (tests/model/test_kv_mixed_decode.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "attention_common.h"
#include "avx2_common.h"

#include <cstdint>
#include <vector>

namespace {

constexpr int kMaxGroupMixed = 16;  // query heads per kv head handled per task

struct ScratchMixed {
  std::vector<float> scores;      // [G, lenp]: scaled scores, then their exps times V's scales
  std::vector<MixedRow> krow;     // [lenp]: each token's K row of this kv head (padding repeats row 0)
  std::vector<MixedRow> vrow;     // [len]
  std::vector<float> ks;          // [lenp]: each token's K scale (1 for fp32 rows, 0 past len)
  std::vector<float> vs;          // [lenp]: each token's V scale (likewise)
  std::vector<float> tile;        // [8, hd]: int8 K rows of a group of eight converted to fp32 (codes, unscaled)
};

// Where one (sequence, kv head) reads: the grids at this kv head's first value / code / scale.
struct Grids {
  const float* blocks;
  const int8_t* codes;
  const float* scales;
};

// One (sequence, kv head): `q` points at the group's G query rows, `out` likewise; `layer` is added to every entry of
// `kidx` and `sidx`; `is8` says which of the sequence's blocks are 8-bit.
void attend_mixed(const float* q, float* out, const Grids& grid, const int64_t* kidx, const int64_t* sidx,
                  const uint8_t* is8, int64_t layer, int64_t v_offset, int64_t len, int64_t bs, int64_t kvh, int64_t hd,
                  int64_t G, float scale, ScratchMixed& sc) {
  const int64_t lenp = (len + 7) & ~int64_t{7};
  const int64_t row_stride = kvh * hd;
  sc.scores.resize(static_cast<size_t>(G * lenp));
  sc.krow.resize(static_cast<size_t>(lenp));
  sc.vrow.resize(static_cast<size_t>(len));
  sc.ks.assign(static_cast<size_t>(lenp), 0.0f);
  sc.vs.assign(static_cast<size_t>(lenp), 0.0f);
  sc.tile.resize(static_cast<size_t>(8 * hd));
  bool any8 = false;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t j = t / bs, row = (kidx[j] + layer) * bs + t % bs, vrow = row + v_offset * bs;
    if (is8[j] != 0) {
      const int64_t srow = (sidx[j] + layer) * bs + t % bs;
      sc.krow[t] = {nullptr, grid.codes + row * row_stride};
      sc.vrow[t] = {nullptr, grid.codes + vrow * row_stride};
      sc.ks[t] = grid.scales[srow * kvh];
      sc.vs[t] = grid.scales[(srow + v_offset * bs) * kvh];
      any8 = true;
    } else {
      sc.krow[t] = {grid.blocks + row * row_stride, nullptr};
      sc.vrow[t] = {grid.blocks + vrow * row_stride, nullptr};
      sc.ks[t] = sc.vs[t] = 1.0f;
    }
  }
  for (int64_t t = len; t < lenp; ++t) sc.krow[t] = sc.krow[0];
  prefetch_rows(sc.krow.data(), sc.vrow.data(), len, hd);
  float* scores = sc.scores.data();
  float* tile = sc.tile.data();
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < lenp; t0 += 8) {
    const float* k[8];
    for (int i = 0; i < 8; ++i) {
      const MixedRow& r = sc.krow[t0 + i];
      k[i] = r.c != nullptr ? widen_row(r.c, tile + i * hd, hd) : r.f;
    }
    const __m256 kscale = _mm256_mul_ps(vscale, _mm256_loadu_ps(sc.ks.data() + t0));
    score8(q, k, G, hd, kscale, pad_lanes(t0, len), scores + t0, lenp);
  }
  float inv[kMaxGroupMixed];
  softmax_heads(scores, lenp, len, G, any8 ? sc.vs.data() : nullptr, inv);  // an fp32-only row: weights times 1
  weighted_heads(scores, lenp, len, sc.vrow.data(), inv, out, G, hd);
}

void check_table(const torch::Tensor& t, const char* name, int64_t B, int64_t nb, c10::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == B && t.size(1) == nb && t.scalar_type() == dtype && t.is_contiguous() &&
                  t.device().is_cpu(),
              name, " must be a contiguous ", c10::toString(dtype), " CPU tensor [", B, ", ", nb, "]");
}

// An entry e (K) and e + v_offset (V) inside a grid of n entries.
bool in_grid(int64_t e, int64_t v_offset, int64_t n) { return e >= 0 && e < n && e + v_offset >= 0 && e + v_offset < n; }

}  // namespace

torch::Tensor paged_decode_attention_mixed(const torch::Tensor& q, const torch::Tensor& blocks,
                                           const torch::Tensor& codes, const torch::Tensor& scales,
                                           const torch::Tensor& k_index, const torch::Tensor& s_index,
                                           const torch::Tensor& is8, int64_t layer, int64_t v_offset,
                                           const torch::Tensor& lens, double scale) {
  TORCH_CHECK(blocks.dim() == 4 && blocks.scalar_type() == torch::kFloat32 && blocks.is_contiguous() &&
                  blocks.device().is_cpu(), "blocks must be a contiguous fp32 CPU tensor [entries, block_size, kv_heads, hd]");
  const int64_t bs = blocks.size(1), kvh = blocks.size(2), hd = blocks.size(3);
  TORCH_CHECK(hd % 8 == 0, "head_dim must be a multiple of 8, got ", hd);
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == torch::kInt8 && codes.is_contiguous() && codes.device().is_cpu() &&
                  codes.size(1) == bs && codes.size(2) == kvh && codes.size(3) == hd,
              "codes must be a contiguous int8 CPU tensor [entries, block_size, kv_heads, hd] of blocks' shape");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() &&
                  scales.device().is_cpu() && scales.size(1) == bs && scales.size(2) == kvh,
              "scales must be a contiguous fp32 CPU tensor [entries, block_size, kv_heads]");
  const int64_t B = q.size(0);
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.size(1) % (kvh * hd) == 0,
              "q must be a contiguous fp32 tensor [B, heads * head_dim]");
  const int64_t G = q.size(1) / (kvh * hd);
  TORCH_CHECK(G >= 1 && G <= kMaxGroupMixed, "query heads per kv head must be 1..", kMaxGroupMixed);
  TORCH_CHECK(k_index.dim() == 2, "k_index must be [B, blocks]");
  const int64_t nb = k_index.size(1);
  check_table(k_index, "k_index", B, nb, torch::kLong);
  check_table(s_index, "s_index", B, nb, torch::kLong);
  check_table(is8, "is8", B, nb, torch::kByte);
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == torch::kLong && lens.is_contiguous(),
              "lens must be a contiguous int64 tensor [B]");
  const int64_t* kp = k_index.data_ptr<int64_t>();
  const int64_t* sp = s_index.data_ptr<int64_t>();
  const uint8_t* fp = is8.data_ptr<uint8_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * bs, "lens[", b, "] = ", lp[b], " outside 1..", nb * bs);
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j) {
      const int64_t i = b * nb + j;
      const bool q8 = fp[i] != 0;
      TORCH_CHECK(in_grid(kp[i] + layer, v_offset, q8 ? codes.size(0) : blocks.size(0)), "k_index[", b, ", ", j,
                  "] + layer out of range of the ", q8 ? "8-bit" : "fp32", " grid");
      TORCH_CHECK(!q8 || in_grid(sp[i] + layer, v_offset, scales.size(0)), "s_index[", b, ", ", j,
                  "] + layer out of range");
    }
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* bp = blocks.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* scp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t grain = B >= 2 * at::get_num_threads() ? kvh : 1;  // as the fp32 kernel splits its tasks
  at::parallel_for(0, B * kvh, grain, [&](int64_t t0, int64_t t1) {
    ScratchMixed scratch;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / kvh, h = task % kvh;
      const int64_t off = b * q.size(1) + h * G * hd;
      attend_mixed(qp + off, op + off, Grids{bp + h * hd, cp + h * hd, scp + h}, kp + b * nb, sp + b * nb, fp + b * nb,
                   layer, v_offset, lp[b], bs, kvh, hd, G, sc, scratch);
    }
  });
  return out;
}
