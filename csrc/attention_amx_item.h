// A prefill work item (one sequence, one KV head, a tile of query rows: attention_items.h) of a
// bf16 pool on AMX. Per span of keys (whole blocks, as paged_attention.cpp takes them):
//   1. the span's keys copied into contiguous rows and its values packed in key pairs;
//   2. Sᵀ = K Qᵀ on AMX tiles (attention_amx.h), the queries packed once per item;
//   3. the online softmax down the keys with sixteen query vectors in the lanes of a register:
//      no reduction across lanes, the causal cut and the window as a per-lane key bound, the
//      rescale of what was accumulated as one vector exp;
//   4. the probabilities transposed to query rows and rounded to bf16 in pairs (as the
//      VDPBF16PS tiles and torch's own bf16 flash attention round them);
//   5. outputs += P V on AMX tiles.
// The same math as the VDPBF16PS tiles (attention_bf16.h) in another order of sums. A 512-token
// prefill chunk of SmolLM2 spent 46 % of its time in those tiles on an AMX host, with the
// row-by-row softmax most of it once the products ran on AMX (docs/BENCHMARKS.md). Soft-capped
// layers keep the VDPBF16PS tiles.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_amx.h"
#include "attention_bf16.h"
#include "attention_tiles.h"
#include "kv_int8.h"
#include "simd.h"

namespace streamgate::cpu {

// Where an item reads and writes: q, k, v and out already offset to the sequence's first row
// and the item's KV head (q/out: its first query head). An int8 pool (kv_int8.h) is read
// through k8/v8 instead of k/v (which are then null), its rows rounded to bf16 as they are copied.
struct AmxItem {
  const c10::BFloat16* q;
  int64_t q_row, q_head;
  const c10::BFloat16 *k, *v;
  int64_t kv_slot;
  const int64_t* table;
  int64_t block_size, ctx, q_len, row_begin, row_end, group, D, span;
  float scale;
  int64_t first_head;
  c10::BFloat16* out;
  int64_t o_row, o_head;
  const int8_t *k8 = nullptr, *v8 = nullptr;
};

// One thread's buffers, sized for items of up to max_q query vectors and spans of `span` keys.
struct AmxScratch {
  int64_t rows16, keys64;
  std::vector<uint32_t> qT, vP;                 // [D/2][rows16] queries in pairs; [keys64/2][D] values
  std::vector<c10::BFloat16> kb, pb, vq;        // [keys64][D] keys; [rows16][keys64] probabilities; 2 int8 values
  std::vector<float> sT, acc, m, l, alpha;      // [keys64][rows16]; [rows16][D]; [rows16] each
  std::vector<int32_t> vis, lo;                 // per query vector: the span's visible keys [lo, vis)
  std::vector<const c10::BFloat16*> qsrc;
  AmxScratch(int64_t max_q, int64_t D, int64_t span)
      : rows16((max_q + 15) / 16 * 16), keys64((span + 63) / 64 * 64),
        qT(max_q ? D / 2 * rows16 : 0), vP(max_q ? keys64 / 2 * D : 0), kb(max_q ? keys64 * D : 0),
        pb(max_q ? rows16 * keys64 : 0), vq(max_q ? 2 * D : 0), sT(max_q ? keys64 * rows16 : 0), acc(max_q ? rows16 * D : 0),
        m(rows16), l(rows16), alpha(rows16), vis(rows16), lo(rows16), qsrc(rows16) {}
};

#if defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__)

// exp(x) for x <= ~0 on sixteen lanes: 2^(x log2 e) as 2^n (VSCALEFPS) times a degree-6
// polynomial of 2^f, |f| <= 1/2 (Taylor: relative error ~1.2e-7, as exp_nonpositive's), eleven
// instructions, as exp_nonpositive's on AVX-512 registers (seventeen before it took VRNDSCALEPS
// and VSCALEFPS). x below -87 (and -inf) gives 2^-126 or less.
inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax of one span for sixteen query vectors (lanes) over keys t < n: sT's column
// block becomes the probabilities (0 outside [lo, vis) and for t in [n, keys32)); m, l and alpha
// (the rescale of what was accumulated) are updated for the sixteen. Full: every lane sees
// every key t < n (no causal cut, no window inside the span: all but the diagonal spans), so no
// masks, and the scale (> 0, so max(x) * scale is the scaled maximum) goes into the exponent's
// FMA instead of a first pass that stores the scaled scores: 2 instructions a vector before
// the exp instead of 7 (a 286-token prompt's attention: the softmax had been ~30 % of it).
template <bool Full>
inline void softmax_lanes(float* sT, int64_t stride, int64_t n, int64_t keys32, float scale, const int32_t* vis,
                          const int32_t* lo, float* m, float* l, float* alpha) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sc = _mm512_set1_ps(scale);
  const __m512 m_old = _mm512_loadu_ps(m);
  __m512 mx = ninf;
  if constexpr (Full) {
    for (int64_t t = 0; t < n; ++t) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sT + t * stride));
    mx = _mm512_mul_ps(mx, sc);
  } else {
    const __m512i vvis = _mm512_loadu_si512(vis), vlo = _mm512_loadu_si512(lo);
    for (int64_t t = 0; t < n; ++t) {
      const __m512i tv = _mm512_set1_epi32(static_cast<int>(t));
      const __mmask16 keep = _mm512_cmplt_epi32_mask(tv, vvis) & _mm512_cmpge_epi32_mask(tv, vlo);
      const __m512 x = _mm512_mask_mul_ps(ninf, keep, _mm512_loadu_ps(sT + t * stride), sc);
      _mm512_storeu_ps(sT + t * stride, x);
      mx = _mm512_max_ps(mx, x);
    }
  }
  const __m512 m_new = _mm512_max_ps(m_old, mx);
  const __mmask16 seen = _mm512_cmp_ps_mask(m_new, ninf, _CMP_NEQ_OQ);     // lanes with a finite max
  // exp(m_old - m_new): 0 (to within 2^-126) where m_old was -inf; 1 where nothing was seen yet.
  const __m512 a = _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.0f), exp16(_mm512_maskz_sub_ps(seen, m_old, m_new)));
  __m512 sum = _mm512_setzero_ps();
  if constexpr (Full) {
    const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m_new);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 p = exp16(_mm512_fmadd_ps(_mm512_loadu_ps(sT + t * stride), sc, neg_m));
      _mm512_storeu_ps(sT + t * stride, p);
      sum = _mm512_add_ps(sum, p);
    }
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const __m512 x = _mm512_loadu_ps(sT + t * stride);
      const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
      const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_maskz_sub_ps(live, x, m_new)));
      _mm512_storeu_ps(sT + t * stride, p);
      sum = _mm512_add_ps(sum, p);
    }
  }
  for (int64_t t = n; t < keys32; ++t) _mm512_storeu_ps(sT + t * stride, _mm512_setzero_ps());
  _mm512_storeu_ps(l, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l), a), sum));
  _mm512_storeu_ps(m, m_new);
  _mm512_storeu_ps(alpha, a);
}

// pb[i][t] = bf16(sT[t][i]) for sixteen query vectors i (sT's column block at g) and keys t <
// keys32: 16 x 16 transposes, then pairs of key blocks rounded to bf16 together.
inline void probs_to_rows(const float* sT, int64_t stride, int64_t keys32, c10::BFloat16* pb, int64_t pstride) {
  for (int64_t t0 = 0; t0 < keys32; t0 += 32) {
    __m512i lo[16], hi[16];
    for (int j = 0; j < 16; ++j) {
      lo[j] = _mm512_loadu_si512(sT + (t0 + j) * stride);
      hi[j] = _mm512_loadu_si512(sT + (t0 + 16 + j) * stride);
    }
    transpose16(lo);
    transpose16(hi);
    for (int i = 0; i < 16; ++i) {
      const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_castsi512_ps(hi[i]), _mm512_castsi512_ps(lo[i]));
      _mm512_storeu_si512(pb + i * pstride + t0, reinterpret_cast<__m512i>(x));
    }
  }
}

inline void tile_item_amx(const AmxItem& w, const Features& f, AmxScratch& sc) {
  const int64_t D = w.D, group = w.group, nq = (w.row_end - w.row_begin) * group;
  const int64_t rows16 = (nq + 15) / 16 * 16, first_pos = w.ctx - w.q_len;
  for (int64_t i = 0; i < rows16; ++i) {                 // query vector i = row * group + g
    const int64_t r = w.row_begin + i / group, g = i % group;
    sc.qsrc[i] = i < nq ? w.q + r * w.q_row + g * w.q_head : nullptr;
    if (i < nq) f.start(sc.m[i], sc.l[i], w.first_head + g);
    else sc.m[i] = 0.0f, sc.l[i] = 1.0f;                 // padding lanes: finite, never written out
  }
  for (int64_t i = 0; i < rows16; i += 16)
    pack_pairs16(sc.qsrc.data() + i, std::min<int64_t>(16, nq - i), sc.qT.data() + i, rows16, D);
  std::fill(sc.acc.begin(), sc.acc.begin() + rows16 * D, 0.0f);
  const int64_t last_pos = first_pos + w.row_end - 1;    // the tile's last query
  for (int64_t b0 = f.first_key(first_pos + w.row_begin); b0 <= last_pos; b0 += w.span) {
    const int64_t n = std::min(w.span, last_pos + 1 - b0), keys32 = (n + 31) / 32 * 32, keys64 = (n + 63) / 64 * 64;
    const c10::BFloat16* vsrc[2] = {nullptr, nullptr};
    for (int64_t t = 0; t < n;) {                        // block by block: one table lookup each
      const int64_t pos = b0 + t, in_block = std::min(w.block_size - pos % w.block_size, n - t);
      const int64_t first = w.table[pos / w.block_size] * w.block_size + pos % w.block_size;
      for (int64_t e = 0; e < in_block; ++e, ++t) {
        const int64_t off = (first + e) * w.kv_slot;
        if (w.k8) {
          dequant_row_bf16(w.k8 + off, sc.kb.data() + t * D, D);
          dequant_row_bf16(w.v8 + off, sc.vq.data() + t % 2 * D, D);
          vsrc[t % 2] = sc.vq.data() + t % 2 * D;
        } else {
          std::memcpy(sc.kb.data() + t * D, w.k + off, D * sizeof(c10::BFloat16));
          vsrc[t % 2] = w.v + off;
        }
        if (t % 2) pack_values_bf16(vsrc[0], vsrc[1], sc.vP.data() + t / 2 * D, D);
      }
    }
    if (n % 2) pack_values_bf16(vsrc[0], nullptr, sc.vP.data() + n / 2 * D, D);
    std::fill(sc.vP.begin() + (n + 1) / 2 * D, sc.vP.begin() + keys32 / 2 * D, 0u);     // finite past n
    std::fill(sc.kb.begin() + n * D, sc.kb.begin() + keys64 * D, c10::BFloat16(0.0f));
    for (int64_t i = 0; i < rows16; ++i) {               // each query vector's keys of the span: [lo, vis)
      const int64_t pos = first_pos + w.row_begin + i / group;
      // Padding lanes see every key: their scores are finite (zero queries) and never written out.
      sc.vis[i] = i < nq ? static_cast<int32_t>(std::clamp<int64_t>(pos + 1 - b0, 0, n)) : static_cast<int32_t>(n);
      sc.lo[i] = i < nq ? static_cast<int32_t>(std::max<int64_t>(0, f.first_key(pos) - b0)) : 0;
    }
    scores_t_amx(sc.kb.data(), keys64, sc.qT.data(), rows16, sc.sT.data(), D);
    for (int64_t g = 0; g < rows16; g += 16) {
      bool full = true;
      for (int64_t i = g; i < g + 16; ++i) full = full && sc.lo[i] == 0 && sc.vis[i] == n;
      (full ? softmax_lanes<true> : softmax_lanes<false>)(sc.sT.data() + g, rows16, n, keys32, w.scale,
                                                           sc.vis.data() + g, sc.lo.data() + g, sc.m.data() + g,
                                                           sc.l.data() + g, sc.alpha.data() + g);
      probs_to_rows(sc.sT.data() + g, rows16, keys32, sc.pb.data() + g * sc.keys64, sc.keys64);
    }
    for (int64_t i = 0; i < rows16; ++i) {               // what was accumulated, rescaled (where the max moved)
      if (sc.alpha[i] == 1.0f) continue;
      const __m512 a = _mm512_set1_ps(sc.alpha[i]);
      float* acc = sc.acc.data() + i * D;
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), a));
    }
    values_amx(sc.pb.data(), sc.keys64, rows16, sc.vP.data(), keys32, sc.acc.data(), D);
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t r = w.row_begin + i / group, g = i % group;
    store_scaled_bf16(w.out + r * w.o_row + g * w.o_head, sc.acc.data() + i * D, 1.0f / sc.l[i], D);
  }
}

#else

inline void tile_item_amx(const AmxItem&, const Features&, AmxScratch&) {}

#endif

}  // namespace streamgate::cpu
