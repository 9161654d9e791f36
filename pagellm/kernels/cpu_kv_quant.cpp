// Paged attention over an 8-bit KV cache (--kv-cache-dtype), float32 and bfloat16 queries.
//
// Formats (fmt): 0 fp8 e4m3 and 1 fp8 e5m2, one byte a value times a per-tensor scale (K and V
// each); 2 int8 with one bfloat16 scale per (token, kv head), kept in tables of their own
// ([slots, kv_heads], indexed like the values). Writing quantizes each new K/V row: fp8 rounds
// x / scale to nearest even, saturated at the format's largest finite value (as torch's
// conversion of the clamped value); int8 takes scale = bf16(absmax / 127) and round-half-even
// of x / scale, clamped to +-127 (as attention/kv_quant.py).
//
// Reading never makes a float copy of the cache; once the step's K/V are written every sequence
// takes one of three kernels, all with an optional sliding window and logit soft-cap:
// - decode rows (chunks of up to kDecodeRows rows; head_dim 64/128, up to 8 query heads a kv
//   head, AVX-512): one item per row, bf16 decode's passes with the rows dequantized in
//   registers (cpu_kv_quant_vec.h; with bfloat16 queries dot products, cpu_kv_quant_dot.h);
// - prefill chunks (head_dim % 16 == 0, <= 256, AVX-512): items of (kv head, tile of rows),
//   each 64-key step's K/V dequantized once for the tile into a thread-local step buffer and
//   run through bf16 vector prefill's micro-kernel (cpu_kv_quant_tile.h; bfloat16 dot products
//   with AVX512-BF16, else float32);
// - anything else (no AVX-512, other head sizes): the plain tile loop below, 16-key chunks
//   dequantized into a per-thread buffer.
// Items run in parallel, the costliest first; each sequence is checked against `bounds` first.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "cpu_kv_quant.h"
#include "cpu_kv_quant_tile.h"
#include "cpu_kv_quant_vec.h"

namespace pagellm {
namespace {

// One of K or V written, quantized; false where some slot lay outside [0, num_slots).
template <typename C>
bool write_rows(int fmt, uint8_t* cache, uint16_t* scales, const typename C::T* x,
                int64_t stride, const int64_t* slots, int64_t num_tokens, int64_t Hkv,
                int64_t D, float scale, int64_t num_slots) {
  return for_each_slot(slots, num_tokens, num_slots, [&](int64_t t) {
    for (int64_t h = 0; h < Hkv; ++h) {
      const typename C::T* src = x + t * stride + h * D;
      uint8_t* dst = cache + (slots[t] * Hkv + h) * D;
      if (fmt == kInt8) {
        float amax = 0.f;
        for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(C::load(src[d])));
        const uint16_t bits = f32_to_bf16(amax / 127.f);
        const float s = bf16_to_f32(bits), div = s == 0.f ? 1.f : s;
        scales[slots[t] * Hkv + h] = bits;
        for (int64_t d = 0; d < D; ++d) {
          const float q = std::min(127.f, std::max(-127.f, std::nearbyint(C::load(src[d]) / div)));
          dst[d] = static_cast<uint8_t>(static_cast<int8_t>(q));
        }
      } else {
        for (int64_t d = 0; d < D; ++d) dst[d] = encode(fmt, C::load(src[d]) / scale);
      }
    }
  });
}

// One thread's buffers: the tile's scaled queries and accumulators, one 16-key chunk's K
// (transposed: 16 keys a dim) and V rows.
struct TileScratch {
  std::vector<float> q, acc, m, l, kt, v, row;
};

// 16 scores of one query against a chunk's transposed K: D broadcast FMAs, no reductions.
inline void scores16(float* sv, const float* qm, const float* kt, int64_t D) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d)
    acc = _mm512_fmadd_ps(_mm512_set1_ps(qm[d]), _mm512_loadu_ps(kt + d * 16), acc);
  _mm512_storeu_ps(sv, acc);
#else
  for (int j = 0; j < 16; ++j) sv[j] = 0.f;
  for (int64_t d = 0; d < D; ++d)
    for (int j = 0; j < 16; ++j) sv[j] += qm[d] * kt[d * 16 + j];
#endif
}

// p[j] = exp(s[j] - m) for 16 lanes; returns their sum.
inline float exp16_sum(float* p, const float* s, float m) {
#if defined(__AVX512F__)
  const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s), _mm512_set1_ps(m)));
  _mm512_storeu_ps(p, e);
  return _mm512_reduce_add_ps(e);
#else
  float sum = 0.f;
  for (int j = 0; j < 16; ++j) sum += (p[j] = std::exp(s[j] - m));
  return sum;
#endif
}

// The plain tile: rows [r0, r0 + R) of a chunk of q_len new tokens whose sequence now holds n
// tokens, and the G query heads of kv head kvh: flash style over 16-key chunks, each chunk's
// K/V rows dequantized once for the whole tile (M = R x G queries).
template <typename C>
void attend_tile(const QuantPlan& P, const typename C::T* q, int64_t q_stride,
                 typename C::T* out, int64_t out_stride, const int32_t* bt, int64_t n,
                 int64_t q_len, int64_t r0, int64_t R, int64_t kvh, TileScratch& s) {
  const int64_t M = R * P.G, D = P.D, first = n - q_len + r0;  // first: row r0's position
  s.q.resize(M * D);
  s.acc.assign(M * D, 0.f);
  s.m.assign(M, -INFINITY);
  s.l.assign(M, 0.f);
  s.kt.resize(D * 16);
  s.v.resize(16 * D);
  s.row.resize(D);
  for (int64_t m = 0; m < M; ++m) {
    const typename C::T* qm = q + (r0 + m / P.G) * q_stride + (kvh * P.G + m % P.G) * D;
    for (int64_t d = 0; d < D; ++d) s.q[m * D + d] = C::load(qm[d]) * P.scale;
  }
  const int64_t lo = P.window > 0 ? std::max<int64_t>(0, first - P.window + 1) : 0;
  const int64_t hi = first + R;  // keys [lo, hi): the last row sees up to its own position
  float sv[16], p[16];
  for (int64_t c0 = lo; c0 < hi; c0 += 16) {
    const int64_t nc = std::min<int64_t>(16, hi - c0);
    for (int64_t j = 0; j < 16; ++j) {
      if (j < nc) {
        const int64_t t = c0 + j;
        const int64_t slot = static_cast<int64_t>(bt[t / P.block_size]) * P.block_size +
                             t % P.block_size;
        P.load(s.row.data(), false, slot, kvh);
        for (int64_t d = 0; d < D; ++d) s.kt[d * 16 + j] = s.row[d];
        P.load(s.v.data() + j * D, true, slot, kvh);
      } else {
        for (int64_t d = 0; d < D; ++d) s.kt[d * 16 + j] = 0.f;
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      const int64_t pos = first + m / P.G;
      scores16(sv, s.q.data() + m * D, s.kt.data(), D);
      float cmax = -INFINITY;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t t = c0 + j;
        const bool ok = j < nc && t <= pos && (P.window == 0 || t > pos - P.window);
        float x = sv[j];
        if (P.soft_cap > 0.f) x = P.soft_cap * std::tanh(x / P.soft_cap);
        sv[j] = ok ? x : -INFINITY;
        cmax = std::max(cmax, sv[j]);
      }
      if (cmax == -INFINITY) continue;  // nothing this row sees in the chunk
      const float mnew = std::max(s.m[m], cmax);
      const float alpha = std::exp(s.m[m] - mnew);  // 0 on the first chunk
      s.l[m] = s.l[m] * alpha + exp16_sum(p, sv, mnew);
      float* a = s.acc.data() + m * D;
      if (alpha != 1.f)
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      for (int64_t j = 0; j < nc; ++j)
        if (p[j] != 0.f) axpy(a, p[j], s.v.data() + j * D, D);
      s.m[m] = mnew;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    typename C::T* om = out + (r0 + m / P.G) * out_stride + (kvh * P.G + m % P.G) * D;
    const float inv = 1.f / s.l[m];
    for (int64_t d = 0; d < D; ++d) om[d] = C::store(s.acc[m * D + d] * inv);
  }
}

// Chunks of up to this many rows take the decode kernel, row by row.
constexpr int64_t kDecodeRows = 4;

// Which kernel an item runs (see the top of the file).
enum ItemKind : int { kDecodeItem, kTileBf16, kTileF32, kPlainTile };

// The tile kernel a prefill chunk takes here: bfloat16 dot products, float32, or the plain loop.
template <typename C>
ItemKind tile_kind(int64_t D) {
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
  if (sizeof(typename C::T) == 2 && D % 32 == 0 && D <= kQuantMaxD) return kTileBf16;
#endif
  if (D % 16 == 0 && D <= kQuantMaxD) return kTileF32;
#endif
  (void)D;
  return kPlainTile;
}

// Every sequence's chunk (its first query row, q_len rows, n tokens after it, its block-table
// row), split into items run in parallel: decode rows, or (kv head, tile of rows); a sequence
// outside `bounds` is skipped whole (kOutOfBounds).
template <typename C>
int attention(const QuantPlan& P, typename C::T* out, int64_t out_stride,
              const typename C::T* q, int64_t q_stride, const int32_t* block_tables,
              int64_t bt_stride, int64_t num_seqs, const int64_t* q_rows,
              const int32_t* q_lens, const int32_t* seq_lens, const int64_t* bt_rows,
              const CacheBounds& bounds) {
#if defined(__AVX512F__)
  const QuantDecodeFns fns = pick_quant_decode(P.fmt, P.G, P.D, sizeof(typename C::T) == 2);
#endif
  const ItemKind tiles = tile_kind<C>(P.D);
  // Rows per tile: enough queries (rows x group) to spread each step's dequantization.
  const int64_t R = tiles == kPlainTile
                        ? std::max<int64_t>(1, std::min<int64_t>(16, 64 / P.G))
                        : std::clamp<int64_t>((384 / P.G + 3) / 4 * 4, 16, 128);
  struct Item {
    int64_t seq, kvh, r0, rows, cost;
    ItemKind kind;
  };
  std::vector<Item> items;
  int out_of_bounds = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t ql = q_lens[i], n = seq_lens[i];
    if (ql < 1 || ql > n || !bounds.rows_ok(q_rows[i], ql) ||
        !bounds.sequence_ok(block_tables, bt_stride, bt_rows[i], n, P.block_size)) {
      out_of_bounds = 1;
      continue;
    }
    const int64_t seen = P.window > 0 ? std::min<int64_t>(P.window, n) : n;  // keys a row sees
#if defined(__AVX512F__)
    if (ql <= kDecodeRows && fns.scores != nullptr) {
      for (int64_t r = 0; r < ql; ++r) items.push_back({i, 0, r, 1, seen * P.H, kDecodeItem});
      continue;
    }
#endif
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh)
      for (int64_t r0 = 0; r0 < ql; r0 += R) {
        const int64_t rows = std::min(R, ql - r0);
        const int64_t keys = std::min(seen + rows, n - ql + r0 + rows);
        items.push_back({i, kvh, r0, rows, keys * rows * P.G, tiles});
      }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
#pragma omp parallel
  {
    TileScratch plain;
#if defined(__AVX512F__)
    QuantDecodeScratch dec;
    QuantTileScratch<float> t32;
#if defined(__AVX512BF16__)
    QuantTileScratch<uint16_t> t16;
#endif
#endif
#pragma omp for schedule(dynamic, 1)
    for (size_t k = 0; k < items.size(); ++k) {
      const Item& it = items[k];
      const typename C::T* qs = q + q_rows[it.seq] * q_stride;
      typename C::T* os = out + q_rows[it.seq] * out_stride;
      const int32_t* bt = block_tables + bt_rows[it.seq] * bt_stride;
      const int64_t n = seq_lens[it.seq], ql = q_lens[it.seq];
      switch (it.kind) {
#if defined(__AVX512F__)
        case kDecodeItem:
          quant_decode_row<C>(P, fns, qs + it.r0 * q_stride, os + it.r0 * out_stride, bt,
                              n - ql + it.r0 + 1, dec);
          break;
        case kTileF32:
          quant_attend_tile<C, float>(P, qs, q_stride, os, out_stride, bt, n, ql, it.r0,
                                      it.rows, it.kvh, t32);
          break;
#if defined(__AVX512BF16__)
        case kTileBf16:
          if constexpr (sizeof(typename C::T) == 2)
            quant_attend_tile<C, uint16_t>(P, qs, q_stride, os, out_stride, bt, n, ql, it.r0,
                                           it.rows, it.kvh, t16);
          break;
#endif
#endif
        default:
          attend_tile<C>(P, qs, q_stride, os, out_stride, bt, n, ql, it.r0, it.rows, it.kvh,
                         plain);
      }
    }
  }
  return out_of_bounds ? kOutOfBounds : 1;
}

}  // namespace
}  // namespace pagellm

using namespace pagellm;

extern "C" {

// Quantize the new K/V rows key/value [T, Hkv, D] (token rows strided; dtype 0 float32, 1
// bfloat16) into their flat slots of the 8-bit caches [num_slots, Hkv, D] (fmt as above; for
// int8 their scales into k_scales/v_scales [num_slots, Hkv]). Returns 1, 0 for a format or dtype
// it does not take, kOutOfBounds where a slot lies outside [0, num_slots) (that token skipped).
int pagellm_write_kv_quant(int fmt, int dtype, void* k_cache, void* v_cache, uint16_t* k_scales,
                           uint16_t* v_scales, const void* key, int64_t k_stride,
                           const void* value, int64_t v_stride, const int64_t* slots,
                           int64_t num_tokens, int64_t Hkv, int64_t D, int64_t num_slots,
                           float k_scale, float v_scale) {
  if (fmt < 0 || fmt > 2 || (dtype != 0 && dtype != 1) || Hkv < 1 || D < 1 ||
      (fmt != kInt8 && (!(k_scale > 0.f) || !(v_scale > 0.f))))
    return 0;
  auto* kc = static_cast<uint8_t*>(k_cache);
  auto* vc = static_cast<uint8_t*>(v_cache);
  bool ok;  // both written whatever the other found (&, not &&)
  if (dtype == 0)
    ok = write_rows<F32>(fmt, kc, k_scales, static_cast<const float*>(key), k_stride, slots,
                         num_tokens, Hkv, D, k_scale, num_slots) &
         write_rows<F32>(fmt, vc, v_scales, static_cast<const float*>(value), v_stride, slots,
                         num_tokens, Hkv, D, v_scale, num_slots);
  else
    ok = write_rows<BF16>(fmt, kc, k_scales, static_cast<const uint16_t*>(key), k_stride,
                          slots, num_tokens, Hkv, D, k_scale, num_slots) &
         write_rows<BF16>(fmt, vc, v_scales, static_cast<const uint16_t*>(value), v_stride,
                          slots, num_tokens, Hkv, D, v_scale, num_slots);
  return ok ? 1 : kOutOfBounds;
}

// Causal paged attention over an 8-bit cache for every sequence of a step (a decode token is a
// chunk of 1): sequence i's q_lens[i] query rows from row q_rows[i] are the last of its
// seq_lens[i] tokens, its block table row bt_rows[i] (as pagellm_prefill_attention's). With a
// sliding window (0: none) a row sees only the last window keys up to its own; soft_cap 0: none.
// Returns 0, doing nothing, for a format, dtype or shape it does not take; kOutOfBounds where a
// sequence lies outside `bounds` (that sequence skipped, nothing outside read).
int pagellm_paged_attention_quant(int fmt, int dtype, void* out, int64_t out_stride,
                                  const void* q, int64_t q_stride, const void* k_cache,
                                  const void* v_cache, const uint16_t* k_scales,
                                  const uint16_t* v_scales, const int32_t* block_tables,
                                  int64_t bt_stride, int64_t num_seqs, const int64_t* q_rows,
                                  const int32_t* q_lens, const int32_t* seq_lens,
                                  const int64_t* bt_rows, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int64_t sliding_window, float soft_cap,
                                  float k_scale, float v_scale, const CacheBounds* bounds) {
  if (fmt < 0 || fmt > 2 || (dtype != 0 && dtype != 1) || sliding_window < 0 || soft_cap < 0.f ||
      !attention_shape_ok(num_heads, num_kv_heads, head_dim, block_size) ||
      (fmt == kInt8 && (k_scales == nullptr || v_scales == nullptr)))
    return 0;
  const QuantPlan P{fmt, num_heads, num_kv_heads, num_heads / num_kv_heads, head_dim,
                    block_size, sliding_window, scale, soft_cap, k_scale, v_scale,
                    static_cast<const uint8_t*>(k_cache), static_cast<const uint8_t*>(v_cache),
                    k_scales, v_scales};
  if (dtype == 0)
    return attention<F32>(P, static_cast<float*>(out), out_stride, static_cast<const float*>(q),
                          q_stride, block_tables, bt_stride, num_seqs, q_rows, q_lens, seq_lens,
                          bt_rows, *bounds);
  return attention<BF16>(P, static_cast<uint16_t*>(out), out_stride,
                         static_cast<const uint16_t*>(q), q_stride, block_tables, bt_stride,
                         num_seqs, q_rows, q_lens, seq_lens, bt_rows, *bounds);
}

}  // extern "C"
