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
// (scores kept per task, max subtracted before exp, a polynomial exp good to about 1e-7): the same function
// as SDPA, summed in another order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "attention_common.h"
#include "avx2_common.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxGroup = 16;  // query heads per kv head handled per task

struct Scratch {
  std::vector<float> scores;         // [G, lenp]: scaled scores, then their exps
  std::vector<const float*> krow;    // [lenp]: each token's K row of this kv head (padding repeats row 0)
  std::vector<const float*> vrow;    // [len]
};

// One (sequence, kv head): `q` points at the group's G query rows (G * hd floats), `out` likewise; `layer`
// is added to every entry of `kidx`.
void attend(const float* q, float* out, const float* blocks, const int64_t* kidx, int64_t layer, int64_t v_offset,
            int64_t len, int64_t bs, int64_t row_stride, int64_t hd, int64_t G, float scale, Scratch& sc) {
  const int64_t lenp = (len + 7) & ~int64_t{7};
  sc.scores.resize(static_cast<size_t>(G * lenp));
  sc.krow.resize(static_cast<size_t>(lenp));
  sc.vrow.resize(static_cast<size_t>(len));
  for (int64_t t = 0; t < len; ++t) {
    const int64_t row = (kidx[t / bs] + layer) * bs + t % bs;
    sc.krow[t] = blocks + row * row_stride;
    sc.vrow[t] = blocks + (row + v_offset * bs) * row_stride;
  }
  for (int64_t t = len; t < lenp; ++t) sc.krow[t] = sc.krow[0];
  // Every K and V line of the task is asked for up front (into L2), K first: a token's rows are 4 lines with a gap
  // of the other kv heads' lines, in blocks scattered over the arena, and left to the hardware prefetcher the task
  // waited on each block in turn (~10 GB/s at 32 sequences of ~96 tokens, against ~26 GB/s a plain read reaches on
  // the 2-core EPYC; with these prefetches ~15 GB/s, README "Paged decode attention"). The V lines then arrive while
  // the scores are computed.
  prefetch_rows(sc.krow.data(), sc.vrow.data(), len, hd);
  float* scores = sc.scores.data();
  // Scores, eight tokens at a time (score8: eight independent FMA chains per query head, reduced together).
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < lenp; t0 += 8) {
    for (int64_t t = t0 + 16; t < std::min(t0 + 24, len); ++t)  // and into L1 two groups of 8 tokens ahead
      for (int64_t d = 0; d < hd; d += 16) _mm_prefetch(reinterpret_cast<const char*>(sc.krow[t] + d), _MM_HINT_T0);
    score8(q, sc.krow.data() + t0, G, hd, vscale, pad_lanes(t0, len), scores + t0, lenp);
  }
  float inv[kMaxGroup];
  softmax_heads(scores, lenp, len, G, nullptr, inv);
  weighted_heads(scores, lenp, len, sc.vrow.data(), inv, out, G, hd);  // out_g = inv_g * sum_t p_gt v_t
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
  // A sequence's kv heads share its K/V rows' cache lines, so with enough sequences for every thread they
  // go to one thread together; a small batch splits them to keep both cores busy.
  const int64_t grain = B >= 2 * at::get_num_threads() ? kvh : 1;
  at::parallel_for(0, B * kvh, grain, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t b = task / kvh, h = task % kvh;
      const int64_t off = b * q.size(1) + h * G * hd;
      attend(qp + off, op + off, bp + h * hd, kp + b * nb, layer, v_offset, lp[b], bs, kvh * hd, hd, G, sc, scratch);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Causal attention of a prompt chunk (fp32, AVX2 + FMA): n query tokens that are the last n of L keys, so query
// token i sees keys 0..L - n + i (a whole prompt: L = n; a chunk after L - n cached tokens: their K/V come first).
//
// Why: torch's SDPA (the CPU flash kernel) reached ~50 GFLOPS at 192-token prompts on the 2-core EPYC, ~10 % of a
// prefill step. Here a task is one kv head and a tile of query tokens: the G query heads of that kv head are
// stacked into G * tile rows, so one pass over the keys serves them all (GQA); each kv head's K is transposed and
// its V packed once per call, and both the scores and P.V are register-tiled GEMMs over 6 rows (1.7-2.0x SDPA at
// 64-256 tokens: README "Prompt attention", `python -m bench.attention_kernels`). Causal: a row's scores run to the next 16 columns past its own key,
// its weights past it are zeroed, and P.V over a block of rows stops at the block's latest key.
//
// Math per query row: the same function as the decode kernel (scale * q.k, max-subtracted exp, normalised
// weighted sum of V), summed in another order than SDPA.
namespace {

constexpr int64_t kPrefillTile = 16;  // query tokens per task
constexpr int kScoreRows = 6;         // query rows per register tile of the score GEMM (6 x 16 columns)

// s[r][c] = scale * q_r . kt[:, c] for RB rows and columns [0, cols), cols a multiple of 16; kt is [hd][ldk].
template <int RB>
void score_rows(const float* const* qr, const float* kt, int64_t ldk, int64_t hd, int64_t cols, float scale, float* s,
                int64_t lds) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    __m256 acc[RB][2];
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* k = kt + c0;
    for (int64_t d = 0; d < hd; ++d, k += ldk) {
      const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
      for (int r = 0; r < RB; ++r) {
        const __m256 qv = _mm256_broadcast_ss(qr[r] + d);
        acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      _mm256_storeu_ps(s + r * lds + c0, _mm256_mul_ps(acc[r][0], vscale));
      _mm256_storeu_ps(s + r * lds + c0 + 8, _mm256_mul_ps(acc[r][1], vscale));
    }
  }
}

void score_rows_any(int rb, const float* const* qr, const float* kt, int64_t ldk, int64_t hd, int64_t cols, float scale,
                    float* s, int64_t lds) {
  switch (rb) {
    case 1: score_rows<1>(qr, kt, ldk, hd, cols, scale, s, lds); break;
    case 2: score_rows<2>(qr, kt, ldk, hd, cols, scale, s, lds); break;
    case 3: score_rows<3>(qr, kt, ldk, hd, cols, scale, s, lds); break;
    case 4: score_rows<4>(qr, kt, ldk, hd, cols, scale, s, lds); break;
    case 5: score_rows<5>(qr, kt, ldk, hd, cols, scale, s, lds); break;
    default: score_rows<kScoreRows>(qr, kt, ldk, hd, cols, scale, s, lds); break;
  }
}

// o_r[8 * j0 .. 8 * (j0 + NV)) = inv_r * sum_{t < len} p_r[t] * v_t for RB rows (p rows ldp apart, v rows hd
// apart): RB * NV accumulators, each V vector loaded once for all rows (RB * NV + NV + 1 <= 16 registers). The
// pragmas matter: without them GCC 12 kept `acc` in memory, a store after every FMA, and this ran at half the
// score GEMM's speed.
template <int RB, int NV>
void weighted_block(const float* p, int64_t ldp, int64_t len, const float* v, int64_t hd, int64_t j0, const float* inv,
                    float* const* o) {
  __m256 acc[RB][NV];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* vt = v + 8 * j0;
  for (int64_t t = 0; t < len; ++t, vt += hd) {
    __m256 vv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) vv[j] = _mm256_loadu_ps(vt + 8 * j);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      const __m256 pt = _mm256_broadcast_ss(p + r * ldp + t);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm256_fmadd_ps(pt, vv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const __m256 scale = _mm256_set1_ps(inv[r]);
    float* orow = o[r] + 8 * j0;
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(orow + 8 * j, _mm256_mul_ps(acc[r][j], scale));
  }
}

template <int RB>
void weighted_block_rows(const float* p, int64_t ldp, int64_t len, const float* v, int64_t hd, const float* inv,
                         float* const* o) {
  const int64_t vecs = hd / 8;
  int64_t j0 = 0;
  for (; j0 + 2 <= vecs; j0 += 2) weighted_block<RB, 2>(p, ldp, len, v, hd, j0, inv, o);
  if (j0 < vecs) weighted_block<RB, 1>(p, ldp, len, v, hd, j0, inv, o);
}

void weighted_block_any(int rb, const float* p, int64_t ldp, int64_t len, const float* v, int64_t hd, const float* inv,
                        float* const* o) {
  switch (rb) {
    case 1: weighted_block_rows<1>(p, ldp, len, v, hd, inv, o); break;
    case 2: weighted_block_rows<2>(p, ldp, len, v, hd, inv, o); break;
    case 3: weighted_block_rows<3>(p, ldp, len, v, hd, inv, o); break;
    case 4: weighted_block_rows<4>(p, ldp, len, v, hd, inv, o); break;
    case 5: weighted_block_rows<5>(p, ldp, len, v, hd, inv, o); break;
    default: weighted_block_rows<kScoreRows>(p, ldp, len, v, hd, inv, o); break;
  }
}

struct PrefillScratch {
  std::vector<float> scores;         // [rows][ldk]
  std::vector<const float*> qrow;    // [rows]
  std::vector<float*> orow;          // [rows]
  std::vector<float> inv;            // [rows]
};

// Kv head h, query tokens [i0, i1) at positions p0 + i: rows r = (i - i0) * G + g for query head h * G + g.
// kt: this head's keys transposed, [hd][ldk] (zero past the last key); vp: its values, [keys][hd].
void prefill_task(const float* q, int64_t sq, const float* kt, int64_t ldk, const float* vp, float* out, int64_t so,
                  int64_t h, int64_t G, int64_t hd, int64_t p0, int64_t i0, int64_t i1, float scale,
                  PrefillScratch& sc) {
  const int64_t rows = (i1 - i0) * G;
  sc.scores.resize(static_cast<size_t>(rows * ldk));
  sc.qrow.resize(static_cast<size_t>(rows));
  sc.orow.resize(static_cast<size_t>(rows));
  sc.inv.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    sc.qrow[r] = q + (i0 + r / G) * sq + (h * G + r % G) * hd;
    sc.orow[r] = out + (i0 + r / G) * so + (h * G + r % G) * hd;
  }
  float* s = sc.scores.data();
  for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
    const int rb = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r0));
    const int64_t last = p0 + i0 + (r0 + rb - 1) / G;  // the latest token among these rows sees keys 0..last
    score_rows_any(rb, sc.qrow.data() + r0, kt, ldk, hd, (last + 16) & ~int64_t{15}, scale, s + r0 * ldk, ldk);
  }
  // A row's weights past its own token are zeroed up to the tile's end: P.V runs a block of rows to its latest token.
  for (int64_t r = 0; r < rows; ++r) sc.inv[r] = softmax_row(s + r * ldk, p0 + i0 + r / G + 1, p0 + i1);
  for (int64_t r0 = 0; r0 < rows; r0 += kScoreRows) {
    const int rb = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r0));
    weighted_block_any(rb, s + r0 * ldk, ldk, p0 + i0 + (r0 + rb - 1) / G + 1, vp, hd, sc.inv.data() + r0,
                       sc.orow.data() + r0);
  }
}

// [n, heads, hd] with the heads of a row adjacent (stride hd, then 1); any row stride.
void check_rows(const torch::Tensor& x, const char* name, int64_t n, int64_t hd) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.size(0) == n &&
                  x.size(2) == hd && x.stride(2) == 1 && x.stride(1) == hd && x.stride(0) >= x.size(1) * hd,
              name, " must be an fp32 CPU tensor [", n, ", heads, ", hd, "] with each row's heads adjacent");
}

}  // namespace

void prefill_attention_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& out,
                        double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [tokens, heads, head_dim]");
  const int64_t n = q.size(0), H = q.size(1), hd = q.size(2);
  TORCH_CHECK(hd % 8 == 0 && hd > 0, "head_dim must be a multiple of 8, got ", hd);
  check_rows(q, "q", n, hd);
  TORCH_CHECK(k.dim() == 3 && k.size(0) >= n, "k must hold at least the ", n, " query tokens' keys");
  const int64_t L = k.size(0), p0 = L - n;
  check_rows(k, "k", L, hd);
  check_rows(v, "v", L, hd);
  const int64_t kvh = k.size(1);
  TORCH_CHECK(v.size(1) == kvh && kvh >= 1 && H % kvh == 0, "heads (", H, ") must be a multiple of kv heads (", kvh, ")");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == H * hd && out.stride(1) == 1 &&
                  out.stride(0) >= H * hd && out.scalar_type() == torch::kFloat32 && out.device().is_cpu(),
              "out must be an fp32 CPU tensor [", n, ", ", H * hd, "] with contiguous rows");
  if (n == 0) return;
  const int64_t G = H / kvh, tiles = (n + kPrefillTile - 1) / kPrefillTile, tasks = tiles * kvh;
  const int64_t ldk = (L + 15) & ~int64_t{15};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Each kv head's keys transposed ([hd][ldk], zero-padded) and values made contiguous ([L][hd]), once: every
  // query tile of the head reads them (V read in place, at the qkv row stride, ran at half the FMA rate).
  std::vector<float> kt(static_cast<size_t>(kvh * hd * ldk), 0.0f), vc(static_cast<size_t>(kvh * L * hd));
  at::parallel_for(0, L, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < kvh; ++h) {
        const float* kr = kp + t * k.stride(0) + h * hd;
        float* ktr = kt.data() + h * hd * ldk + t;
        for (int64_t d = 0; d < hd; ++d) ktr[d * ldk] = kr[d];
        std::memcpy(vc.data() + (h * L + t) * hd, vp + t * v.stride(0) + h * hd, sizeof(float) * hd);
      }
  });
  // Later tiles see more keys: tasks are handed out one at a time, the costliest first, so the threads finish together.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    PrefillScratch scratch;
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t tile = tiles - 1 - task / kvh, h = task % kvh;
      const int64_t i0 = tile * kPrefillTile, i1 = std::min(n, i0 + kPrefillTile);
      prefill_task(qp, q.stride(0), kt.data() + h * hd * ldk, ldk, vc.data() + h * L * hd, op, out.stride(0), h, G, hd,
                   p0, i0, i1, sc, scratch);
    }
  });
}
