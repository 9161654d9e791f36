// Causal attention of prefill chunks over the paged KV cache with AMX (bfloat16), flash style.
//
// A chunk's K/V (its context and its own new rows, already written to the cache) are first
// regrouped per (sequence, kv head) into tiles: K transposed as dim pairs x 16 keys, the B
// operand of the scores; V as key pairs x 16 dims, the B operand of P.V. Then each work item,
// 16 query rows of one sequence and kv head, runs every query head of that group over the keys
// its last row may see, 32 at a time: two score tiles, an online softmax in float32 (AVX-512),
// P rounded to bfloat16 as the A tile, P.V into float32 accumulators. Masked scores count as
// exactly zero; sums and the output are float32 until the final bfloat16 rounding.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"

namespace pagellm {
namespace {

#if defined(PAGELLM_AMX)
constexpr int64_t kTile = 512;  // bf16 elements per tile

struct Seq {
  int64_t q_row;   // first query row in q / out
  int64_t q_len;   // new rows of this chunk
  int64_t ctx;     // tokens in the cache after this chunk (context + q_len)
  int64_t bt_row;  // row of block_tables
  int64_t packed;  // offset of its packed K/V (elements) in the workspace, per kv head
};

// Tokens' K/V row in the cache: [block][slot][kv head][D].
inline const uint16_t* cache_row(const uint16_t* cache, const int32_t* bt, int64_t tok,
                                 int64_t block_size, int64_t Hkv, int64_t D, int64_t h) {
  const int64_t block = bt[tok / block_size];
  return cache + ((block * block_size + tok % block_size) * Hkv + h) * D;
}

// K of keys [k0, k0 + 16) as D/32 tiles [16 dim pairs][16 keys][2]; keys at or past ctx are 0.
void pack_k(uint16_t* dst, const uint16_t* k_cache, const int32_t* bt, int64_t k0, int64_t ctx,
            int64_t block_size, int64_t Hkv, int64_t D, int64_t h) {
  __m512i r[16];
  for (int64_t half = 0; half < D / 32; ++half) {
    for (int64_t n = 0; n < 16; ++n) {
      const int64_t tok = k0 + n;
      r[n] = tok < ctx ? _mm512_loadu_si512(cache_row(k_cache, bt, tok, block_size, Hkv, D, h) +
                                            half * 32)
                       : _mm512_setzero_si512();
    }
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + half * kTile + i * 32, r[i]);
  }
}

// V of keys [k0, k0 + 32) as D/16 tiles [16 key pairs][16 dims][2]; keys past ctx are 0.
void pack_v(uint16_t* dst, const uint16_t* v_cache, const int32_t* bt, int64_t k0, int64_t ctx,
            int64_t block_size, int64_t Hkv, int64_t D, int64_t h) {
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t p = 0; p < 16; ++p) {
    const int64_t t0 = k0 + 2 * p, t1 = t0 + 1;
    const uint16_t* r0 = t0 < ctx ? cache_row(v_cache, bt, t0, block_size, Hkv, D, h) : nullptr;
    const uint16_t* r1 = t1 < ctx ? cache_row(v_cache, bt, t1, block_size, Hkv, D, h) : nullptr;
    for (int64_t dd = 0; dd < D / 16; ++dd) {
      const __m256i a = r0 ? _mm256_loadu_si256((const __m256i*)(r0 + dd * 16)) : zero;
      const __m256i b = r1 ? _mm256_loadu_si256((const __m256i*)(r1 + dd * 16)) : zero;
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      _mm512_storeu_si512(dst + dd * kTile + p * 32, pair);
    }
  }
}

// 16 query rows [r0, r0 + 16) of `s` (rows past q_len repeat the last one, not stored) for
// every head of kv head h's group.
void attend_block(uint16_t* out, int64_t out_stride, const uint16_t* q, int64_t q_stride,
                  const Seq& s, const uint16_t* kt, const uint16_t* vt, int64_t r0, int64_t h,
                  int64_t G, int64_t D, float scale) {
  const int64_t rows = std::min<int64_t>(16, s.q_len - r0);
  const int64_t first_pos = s.ctx - s.q_len;  // position of row 0
  // Keys the block's last row sees, in 32-key steps.
  const int64_t last_key = first_pos + r0 + rows - 1;
  const int64_t steps = last_key / 32 + 1;
  const int64_t halves = D / 32, dblocks = D / 16;
  alignas(64) uint16_t qbuf[16 * 256];
  alignas(64) float sc[16 * 32];
  alignas(64) uint16_t pb[16 * 32];
  alignas(64) float pv[16 * 64];
  std::vector<float> o(16 * D);
  alignas(64) float m[16], l[16], alpha[16];  // m: running row maxima (unscaled scores)
  const float c = scale * 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(c);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t head = h * G + g;
    // Query rows (a partial block copied, its missing rows repeating the last one).
    const uint16_t* qa = q + (s.q_row + r0) * q_stride + head * D;
    int64_t qa_stride = q_stride;
    if (rows < 16) {
      for (int64_t r = 0; r < 16; ++r)
        std::memcpy(qbuf + r * D, qa + std::min(r, rows - 1) * q_stride, D * 2);
      qa = qbuf;
      qa_stride = D;
    }
    std::fill(o.begin(), o.end(), 0.f);
    std::fill(m, m + 16, -INFINITY);
    std::fill(l, l + 16, 0.f);
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t k0 = step * 32;
      // Scores: keys [k0, k0 + 16) in tile 0, [k0 + 16, k0 + 32) in tile 1.
      _tile_zero(0);
      _tile_zero(1);
      const uint16_t* ka = kt + (2 * step) * halves * kTile;
      const uint16_t* kb = ka + halves * kTile;
      for (int64_t half = 0; half < halves; ++half) {
        _tile_loadd(6, qa + half * 32, qa_stride * 2);
        _tile_loadd(4, ka + half * kTile, 64);
        _tile_loadd(5, kb + half * kTile, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
      }
      _tile_stored(0, sc, 128);
      _tile_stored(1, sc + 16, 128);
      // Online softmax per row, in base 2 with the scale folded in (p = 2^(s c - m c), c =
      // scale log2 e; the row maxima m are kept unscaled). Keys past a row's position are
      // masked; only steps reaching past the block's first row need masks at all.
      const bool full = k0 + 31 <= first_pos + r0;
      __mmask16 mask0[16], mask1[16];
      alignas(64) float mx[16];
      for (int64_t r = 0; r < 16; ++r) {
        __m512 s0 = _mm512_loadu_ps(sc + r * 32), s1 = _mm512_loadu_ps(sc + r * 32 + 16);
        if (!full) {
          const int64_t pos = first_pos + r0 + std::min(r, rows - 1);
          // Keys of this step the row sees: none for an early row of a block on the diagonal
          // (its maximum is then already finite: key 0 is visible to every row at step 0).
          const int64_t visible = std::clamp<int64_t>(pos - k0 + 1, 0, 32);
          mask0[r] = visible >= 16 ? 0xFFFF : (__mmask16)((1u << visible) - 1);
          mask1[r] = visible >= 32 ? 0xFFFF
                     : visible <= 16 ? 0 : (__mmask16)((1u << (visible - 16)) - 1);
          s0 = _mm512_mask_mov_ps(neg_inf, mask0[r], s0);
          s1 = _mm512_mask_mov_ps(neg_inf, mask1[r], s1);
          _mm512_storeu_ps(sc + r * 32, s0);
          _mm512_storeu_ps(sc + r * 32 + 16, s1);
        }
        mx[r] = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      }
      // 2^(-inf) is exp2_16's clamp, 2^-125: the first step's o and l are 0 anyway.
      const __m512 vmx = _mm512_load_ps(mx);
      _mm512_store_ps(alpha, exp2_16(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(m), vmx), vc)));
      _mm512_store_ps(m, vmx);
      for (int64_t r = 0; r < 16; ++r) {
        const __m512 rm = _mm512_set1_ps(mx[r] * c);
        // Masked scores are -inf: 2^(-inf) clamps to 2^-125, zeroed by the masks below.
        __m512 p0 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(sc + r * 32), vc, rm));
        __m512 p1 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(sc + r * 32 + 16), vc, rm));
        if (!full) {
          p0 = _mm512_maskz_mov_ps(mask0[r], p0);
          p1 = _mm512_maskz_mov_ps(mask1[r], p1);
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        _mm256_storeu_si256((__m256i*)(pb + r * 32), to_bf16x16(p0));
        _mm256_storeu_si256((__m256i*)(pb + r * 32 + 16), to_bf16x16(p1));
      }
      // P.V, 4 dim blocks (64 dims) at a time, then o = o * alpha + P.V.
      _tile_loadd(5, pb, 64);
      const uint16_t* vb = vt + step * dblocks * kTile;
      for (int64_t d0 = 0; d0 < dblocks; d0 += 4) {
        const int64_t n = std::min<int64_t>(4, dblocks - d0);
        _tile_zero(0);
        _tile_loadd(4, vb + d0 * kTile, 64);
        _tile_dpbf16ps(0, 5, 4);
        _tile_stored(0, pv, 256);
        if (n > 1) {
          _tile_zero(1);
          _tile_loadd(4, vb + (d0 + 1) * kTile, 64);
          _tile_dpbf16ps(1, 5, 4);
          _tile_stored(1, pv + 16, 256);
        }
        if (n > 2) {
          _tile_zero(2);
          _tile_loadd(4, vb + (d0 + 2) * kTile, 64);
          _tile_dpbf16ps(2, 5, 4);
          _tile_stored(2, pv + 32, 256);
        }
        if (n > 3) {
          _tile_zero(3);
          _tile_loadd(4, vb + (d0 + 3) * kTile, 64);
          _tile_dpbf16ps(3, 5, 4);
          _tile_stored(3, pv + 48, 256);
        }
        for (int64_t r = 0; r < 16; ++r) {
          const __m512 a = _mm512_set1_ps(alpha[r]);
          float* orow = o.data() + r * D + d0 * 16;
          for (int64_t j = 0; j < n; ++j)
            _mm512_storeu_ps(orow + j * 16, _mm512_fmadd_ps(_mm512_loadu_ps(orow + j * 16), a,
                                                            _mm512_loadu_ps(pv + r * 64 + j * 16)));
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      uint16_t* dst = out + (s.q_row + r0 + r) * out_stride + head * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i*)(dst + d),
                            to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + d), inv)));
    }
  }
}
#endif

}  // namespace
}  // namespace pagellm

extern "C" {

// Whether pagellm_prefill_attention takes this shape here: AMX granted, head_dim a multiple of
// 32 up to 256.
int pagellm_prefill_attention_supported(int64_t head_dim) {
#if defined(PAGELLM_AMX)
  return pagellm::amx_permitted() && head_dim % 32 == 0 && head_dim <= 256 ? 1 : 0;
#else
  (void)head_dim;
  return 0;
#endif
}

// Sequence i's rows [q_rows[i], q_rows[i] + q_lens[i]) of q [*, H, D] (row stride q_stride) are
// the last q_lens[i] of its ctx_lens[i] cached tokens (K/V already written, block table row
// bt_rows[i]); each attends causally to the cache and is written at the same row of out.
// bfloat16 only; returns 0, doing nothing, where pagellm_prefill_attention_supported is 0.
int pagellm_prefill_attention(void* out, int64_t out_stride, const void* q, int64_t q_stride,
                              const void* k_cache, const void* v_cache,
                              const int32_t* block_tables, int64_t bt_stride, int64_t num_seqs,
                              const int64_t* q_rows, const int32_t* q_lens,
                              const int32_t* ctx_lens, const int64_t* bt_rows, int64_t H,
                              int64_t Hkv, int64_t D, int64_t block_size, float scale) {
#if defined(PAGELLM_AMX)
  using namespace pagellm;
  if (!pagellm_prefill_attention_supported(D)) return 0;
  const int64_t G = H / Hkv;
  // Packed K/V per (sequence, kv head): keys rounded up to 32; K then V.
  std::vector<Seq> seqs(num_seqs);
  int64_t total = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t keys = (ctx_lens[i] + 31) / 32 * 32;
    seqs[i] = Seq{q_rows[i], q_lens[i], ctx_lens[i], bt_rows[i], total};
    total += keys * D * 2 * Hkv;
  }
  static thread_local std::vector<uint16_t> ws;
  if (ws.size() < static_cast<size_t>(total)) ws.resize(total);
  uint16_t* packed = ws.data();
  // Work: (sequence, kv head, 32 keys) to pack; (sequence, kv head, 16 rows) to attend.
  std::vector<int64_t> pack_items, attend_items;  // sequence * 2^40 + head * 2^32 + block
  for (int64_t i = 0; i < num_seqs; ++i)
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t b = 0; b < (seqs[i].ctx + 31) / 32; ++b)
        pack_items.push_back((i << 40) | (h << 32) | b);
      for (int64_t b = 0; b < (seqs[i].q_len + 15) / 16; ++b)
        attend_items.push_back((i << 40) | (h << 32) | b);
    }
  // Longest rows first: late rows of a long chunk see the most keys.
  std::sort(attend_items.begin(), attend_items.end(), [&](int64_t a, int64_t b) {
    const Seq& sa = seqs[a >> 40];
    const Seq& sb = seqs[b >> 40];
    return sa.ctx - sa.q_len + (a & 0xffffffff) * 16 > sb.ctx - sb.q_len + (b & 0xffffffff) * 16;
  });
  const auto* kc = static_cast<const uint16_t*>(k_cache);
  const auto* vc = static_cast<const uint16_t*>(v_cache);
  const int64_t n_pack = pack_items.size(), n_attend = attend_items.size();
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < n_pack; ++it) {
      const int64_t i = pack_items[it] >> 40, h = (pack_items[it] >> 32) & 0xff;
      const int64_t b = pack_items[it] & 0xffffffff;
      const Seq& s = seqs[i];
      const int64_t keys = (s.ctx + 31) / 32 * 32;
      uint16_t* kt = packed + s.packed + h * keys * D * 2;
      uint16_t* vt = kt + keys * D;
      const int32_t* bt = block_tables + s.bt_row * bt_stride;
      pack_k(kt + (2 * b) * D * 16, kc, bt, b * 32, s.ctx, block_size, Hkv, D, h);
      pack_k(kt + (2 * b + 1) * D * 16, kc, bt, b * 32 + 16, s.ctx, block_size, Hkv, D, h);
      pack_v(vt + b * D * 32, vc, bt, b * 32, s.ctx, block_size, Hkv, D, h);
    }
    FullTiles tiles;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_attend; ++it) {
      const int64_t i = attend_items[it] >> 40, h = (attend_items[it] >> 32) & 0xff;
      const int64_t b = attend_items[it] & 0xffffffff;
      const Seq& s = seqs[i];
      const int64_t keys = (s.ctx + 31) / 32 * 32;
      const uint16_t* kt = packed + s.packed + h * keys * D * 2;
      attend_block(static_cast<uint16_t*>(out), out_stride, static_cast<const uint16_t*>(q),
                   q_stride, s, kt, kt + keys * D, b * 16, h, G, D, scale);
    }
  }
  return 1;
#else
  (void)out; (void)out_stride; (void)q; (void)q_stride; (void)k_cache; (void)v_cache;
  (void)block_tables; (void)bt_stride; (void)num_seqs; (void)q_rows; (void)q_lens;
  (void)ctx_lens; (void)bt_rows; (void)H; (void)Hkv; (void)D; (void)block_size; (void)scale;
  return 0;
#endif
}

}  // extern "C"
