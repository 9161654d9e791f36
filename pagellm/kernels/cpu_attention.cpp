// Paged attention and KV-cache writes on the CPU, float32 and bfloat16.
//
// Each work item is one query row attending to the first L cached tokens of its sequence: a
// decode token, or one token of a prefill chunk (L = its position + 1) once the chunk's K/V are
// in the cache. Decode is bound by reading K/V from memory, so an item reads every cache row
// (all kv heads of a token, contiguous) once, block by block, with the blocks PF ahead
// prefetched (blocks are scattered, which defeats the hardware prefetcher at each block edge).
// An item runs three named passes, each with one implementation per path:
// - scores: every head's q . k for 16 tokens at a time; with AMX (bfloat16, up to 16 heads,
//   blocks of whole 16-token tiles) as one tile product per (kv head, 32 dims) of the K rows
//   against the query group's transposed rows (cpu_attention_amx.h), else with AVX512-BF16 dot
//   products (unrolled for head sizes 64 and 128) and a transpose-add tree, else plain loops
//   (cpu_attention_vec.h); then the softmax numerators and 1 / their sums;
// - P.V: the accumulators of a kv head's query group held in registers: on the bfloat16 vector
//   path as dot products of two tokens' V rows interleaved against the pair of their weights
//   rounded to bfloat16 (fewer instructions than FMAs on converted V), else float32 FMAs;
// - store: normalized, rounded once to the cache's dtype.
// Softmax and accumulation are float32. The entry point refuses (returns 0) a shape it cannot
// index safely before any division by a size.

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "cpu_amx.h"
#include "cpu_attention_amx.h"
#include "cpu_attention_vec.h"
#include "cpu_common.h"
#include "cpu_entry_points.h"

namespace pagellm {
namespace {

// How many blocks ahead K/V are prefetched.
constexpr int64_t PF = 2;

// A block's cache lines split into `parts` slices, prefetched one slice at a time: spreads a
// block's prefetches over the compute of the block before it (a burst of them fills the
// line-fill buffers and stalls). The division is done once per call, not per slice; parts
// under 1 count as 1 (one slice: the whole block).
struct PrefetchSlices {
  int64_t lines, per;
  PrefetchSlices(int64_t bytes, int64_t parts)
      : lines((bytes + 63) / 64),
        per((lines + std::max<int64_t>(parts, 1) - 1) / std::max<int64_t>(parts, 1)) {}
  // Locality 3 (T0) into L1, 2 (T1) into L2.
  template <int Locality = 3>
  void fetch(const void* p, int64_t part) const {
    const char* c = static_cast<const char*>(p);
    for (int64_t l = part * per; l < std::min(lines, (part + 1) * per); ++l)
      __builtin_prefetch(c + l * 64, 0, Locality);
  }
  void operator()(const void* p, int64_t part) const { fetch<3>(p, part); }
  void to_l2(const void* p, int64_t part) const { fetch<2>(p, part); }
};

// How one block's prefetches are sliced in each pass: per 16-token tile (AMX scores), per query
// head (vector scores), per kv head (P.V). A block of fewer than 16 tokens has no whole tile:
// one slice then (that block size never takes the AMX path).
struct BlockSlices {
  PrefetchSlices per_tile, per_head, per_kv_head;
  BlockSlices(int64_t block_bytes, int64_t block_size, int64_t H, int64_t Hkv)
      : per_tile(block_bytes, block_size / 16),
        per_head(block_bytes, H),
        per_kv_head(block_bytes, Hkv) {}
};

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// Whether this call takes the AMX path: bfloat16, all heads in one tile's 16 rows/columns,
// whole 32-dim halves and whole 16-token tiles per block.
template <typename C>
bool use_amx(int64_t H, int64_t D, int64_t block_size) {
#if defined(PAGELLM_AMX)
  return sizeof(typename C::T) == 2 && H <= 16 && D % 32 == 0 && block_size % 16 == 0 &&
         amx_permitted();
#else
  (void)H;
  (void)D;
  (void)block_size;
  return false;
#endif
}

// What one call fixes for all its items: the shape, the path and the kernels picked for it.
template <typename C>
struct DecodePlan {
  using T = typename C::T;
  int64_t H, Hkv, G, D, row, block_size, block_elems, block_bytes;
  float scale;
  // Sliding window W (0: none): the query at position L - 1 sees keys L - W .. L - 1.
  // soft_cap c (0: none): scores become c * tanh(score / c). Either takes the vector path.
  int64_t window;
  float soft_cap;
  bool amx;
  AccumulateFn<T> accumulate;  // register-blocked float32 P.V, or null
  ScoresFn<C> block_scores;
  PairsFn pairs;  // bfloat16 P.V as token-pair dot products, or null
  BlockSlices slices;

  DecodePlan(int64_t H_, int64_t Hkv_, int64_t D_, int64_t block_size_, float scale_,
             int64_t window_ = 0, float soft_cap_ = 0.f)
      : H(H_), Hkv(Hkv_), G(H_ / Hkv_), D(D_), row(Hkv_ * D_), block_size(block_size_),
        block_elems(block_size_ * Hkv_ * D_),
        block_bytes(block_elems * static_cast<int64_t>(sizeof(T))), scale(scale_),
        window(window_), soft_cap(soft_cap_),
        amx(use_amx<C>(H_, D_, block_size_) && window_ == 0 && soft_cap_ == 0.f),
        accumulate(pick_accumulate<T>(G, D_)),
        block_scores(pick_scores<C>(D_)), pairs(pick_pairs_for<T>(amx, G, D_)),
        slices(block_bytes, block_size_, H_, Hkv_) {}

 private:
  template <typename U>
  static PairsFn pick_pairs_for(bool amx_path, int64_t g, int64_t d) {
#if defined(__AVX512BF16__)
    if constexpr (sizeof(U) == 2)
      if (!amx_path) return pick_pairs(g, d);
#endif
    (void)amx_path;
    (void)g;
    (void)d;
    return nullptr;
  }
};

// One thread's buffers, reused across its items. Scores: [head][token] on the vector path,
// [token][16 lanes = heads] on the AMX path; inv: 1 / the softmax sum per head (16 lanes at
// once on the AMX path); p: where p[head g][token j] lies in scores (scores + g * pg + j * pj).
struct DecodeScratch {
  std::vector<float> acc, scores, inv;
  std::vector<uint16_t> qt, pbuf;
  int64_t pg = 0, pj = 1;
};

// One item's sequence: its block table row and how many cached tokens it attends to. With a
// window, bt starts at the block of the window's first key and L counts from that block's
// start; its first `skip` tokens lie before the window (masked out of the softmax).
template <typename T>
struct DecodeItem {
  const T* q;
  const int32_t* bt;
  int64_t L, nblocks;
  int64_t skip = 0;
};

template <typename C>
void scores_amx(const DecodePlan<C>& P, DecodeScratch& s, const DecodeItem<typename C::T>& it,
                const typename C::T* k_cache) {
#if defined(PAGELLM_AMX)
  using T = typename C::T;
  s.scores.resize(it.nblocks * P.block_size * 16);
  build_query_tiles(s.qt.data(), reinterpret_cast<const uint16_t*>(it.q), P.H, P.G, P.Hkv, P.D);
  const int64_t nqt = P.Hkv * (P.D / 32);
  const bool resident = nqt <= kResidentQueryTiles;
  if (resident) load_query_tiles(s.qt.data(), nqt);
  for (int64_t b = 0; b < it.nblocks; ++b) {
    const T* kb = k_cache + it.bt[b] * P.block_elems;
    const T* kn = b + PF < it.nblocks ? k_cache + it.bt[b + PF] * P.block_elems : nullptr;
    for (int64_t j0 = 0; j0 < P.block_size && b * P.block_size + j0 < it.L; j0 += 16) {
      if (kn != nullptr) P.slices.per_tile(kn, j0 / 16);
      amx_block_scores(s.scores.data() + (b * P.block_size + j0) * 16,
                       reinterpret_cast<const uint16_t*>(kb + j0 * P.row), P.row, s.qt.data(),
                       P.Hkv, P.D, resident);
    }
  }
  softmax_columns(s.scores.data(), it.L, P.scale, s.inv.data());
  s.pg = 1;
  s.pj = 16;
#else
  (void)P;
  (void)s;
  (void)it;
  (void)k_cache;
#endif
}

template <typename C>
void scores_vec(const DecodePlan<C>& P, DecodeScratch& s, const DecodeItem<typename C::T>& it,
                const typename C::T* k_cache, const typename C::T* v_cache) {
  using T = typename C::T;
  s.scores.resize(P.H * it.L);
  for (int64_t b = 0; b < it.nblocks; ++b) {
    const T* kb = k_cache + it.bt[b] * P.block_elems;
    const T* kn = b + PF < it.nblocks ? k_cache + it.bt[b + PF] * P.block_elems : nullptr;
    // The K block PF ahead and this block's V (for the P.V pass) go to L2, not L1: on Zen 4,
    // L1 prefetches of scattered blocks fill its miss buffers and stall the dot products
    // (decode attention read 17.5 GB/s with them, 21.4 without: docs/performance.md).
    const T* vl2 = v_cache + it.bt[b] * P.block_elems;
    const int64_t t0 = b * P.block_size;
    const int64_t n = std::min(it.L - t0, P.block_size);
    for (int64_t j0 = 0; j0 < n; j0 += 16)
      for (int64_t h = 0; h < P.H; ++h) {
        if (kn != nullptr && j0 == 0) P.slices.per_head.to_l2(kn, h);
        if (j0 == 0) P.slices.per_head.to_l2(vl2, h);
        P.block_scores(s.scores.data() + h * it.L + t0 + j0, it.q + h * P.D,
                       kb + j0 * P.row + (h / P.G) * P.D, P.row, std::min<int64_t>(16, n - j0),
                       P.D, P.scale);
      }
  }
  if (P.soft_cap > 0.f)
    for (int64_t h = 0; h < P.H; ++h) {
      float* row_scores = s.scores.data() + h * it.L;
      for (int64_t t = it.skip; t < it.L; ++t)
        row_scores[t] = P.soft_cap * std::tanh(row_scores[t] / P.soft_cap);
    }
  for (int64_t h = 0; h < P.H; ++h)
    std::fill_n(s.scores.data() + h * it.L, it.skip, -INFINITY);  // exp gives 0
  for (int64_t h = 0; h < P.H; ++h)
    s.inv[h] = softmax_unnormalized(s.scores.data() + h * it.L, it.L);
  s.pg = it.L;
  s.pj = 1;
}

// acc[h] = sum_t p[h][t] * v_t, kv head by kv head, block by block.
template <typename C>
void accumulate_v(const DecodePlan<C>& P, DecodeScratch& s, const DecodeItem<typename C::T>& it,
                  const typename C::T* v_cache) {
  using T = typename C::T;
  for (int64_t b = 0; b < std::min<int64_t>(PF, it.nblocks); ++b)
    prefetch_bytes(v_cache + it.bt[b] * P.block_elems, P.block_bytes);
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  // p as bfloat16 [head][token] (row length even) where the pairs serve.
  const int64_t Lp = it.L + (it.L & 1);
  if (P.pairs != nullptr) {
    s.pbuf.resize(P.H * Lp);
    for (int64_t h = 0; h < P.H; ++h)
      to_bf16_row(s.pbuf.data() + h * Lp, s.scores.data() + h * it.L, it.L);
  }
  for (int64_t b = 0; b < it.nblocks; ++b) {
    const T* vb = v_cache + it.bt[b] * P.block_elems;
    const T* vn = b + PF < it.nblocks ? v_cache + it.bt[b + PF] * P.block_elems : nullptr;
    const int64_t t0 = b * P.block_size;
    const int64_t n = std::min(it.L - t0, P.block_size);
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
      if (vn != nullptr) P.slices.per_kv_head(vn, kvh);
      float* a = s.acc.data() + kvh * P.G * P.D;
      const float* p = s.scores.data() + kvh * P.G * s.pg + t0 * s.pj;
      if (P.pairs != nullptr)
        P.pairs(a, s.pbuf.data() + kvh * P.G * Lp + t0, Lp,
                reinterpret_cast<const uint16_t*>(vb + kvh * P.D), P.row, n);
      else if (P.accumulate != nullptr)
        P.accumulate(a, p, s.pg, s.pj, vb + kvh * P.D, P.row, n);
      else
        accumulate_block_generic(a, p, s.pg, s.pj, P.G, vb + kvh * P.D, P.row, n, P.D);
    }
  }
}

// out row = acc / sum, rounded once; the pairs' accumulators hold the dims permuted.
template <typename C>
void store_output(const DecodePlan<C>& P, const DecodeScratch& s, typename C::T* orow) {
  for (int64_t h = 0; h < P.H; ++h)
    for (int64_t k = 0; k < P.D; ++k)
      orow[h * P.D + (P.pairs != nullptr ? pair_acc_dim(k) : k)] =
          C::store(s.acc[h * P.D + k] * s.inv[h]);
}

// The dispatcher: items in parallel, each checked against the bounds, then through scores (AMX or
// vector), P.V and store. Returns 1, or kOutOfBounds where an item was skipped.
template <typename C>
int paged_attention(typename C::T* out, int64_t out_stride, const typename C::T* q,
                     int64_t q_stride, const int64_t* token_rows, const typename C::T* k_cache,
                     const typename C::T* v_cache, const int32_t* block_tables,
                     int64_t bt_stride, const int32_t* item_lens, const int64_t* item_bt_rows,
                     int64_t num_items, const DecodePlan<C>& P, const CacheBounds& bounds) {
  using T = typename C::T;
  int out_of_bounds = 0;
#pragma omp parallel
  {
    DecodeScratch s;
    s.acc.resize(P.H * P.D);
    s.inv.resize(std::max<int64_t>(P.H, 16));
#if defined(PAGELLM_AMX)
    std::unique_ptr<FullTiles> tiles;
    if (P.amx) {
      tiles = std::make_unique<FullTiles>();
      s.qt.resize(P.Hkv * (P.D / 32) * 512);
    }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_items; ++i) {
      const int64_t L = item_lens[i];
      if (!bounds.rows_ok(token_rows[i], 1) ||
          !bounds.sequence_ok(block_tables, bt_stride, item_bt_rows[i], L, P.block_size)) {
#pragma omp atomic write
        out_of_bounds = 1;
        continue;
      }
      // A window drops the blocks before its first key: they may be freed (another
      // request's now).
      const int64_t start = P.window > 0 && L > P.window ? L - P.window : 0;
      const int64_t first = start / P.block_size;
      const int64_t Lw = L - first * P.block_size;
      const DecodeItem<T> it{q + token_rows[i] * q_stride,
                             block_tables + item_bt_rows[i] * bt_stride + first, Lw,
                             (Lw + P.block_size - 1) / P.block_size, start - first * P.block_size};
      for (int64_t b = 0; b < std::min<int64_t>(PF, it.nblocks); ++b)
        prefetch_bytes(k_cache + it.bt[b] * P.block_elems, P.block_bytes);
      if (P.amx)
        scores_amx(P, s, it, k_cache);
      else
        scores_vec(P, s, it, k_cache, v_cache);
      accumulate_v(P, s, it, v_cache);
      store_output(P, s, out + token_rows[i] * out_stride);
    }
  }
  return out_of_bounds ? kOutOfBounds : 1;
}

// Returns 1, or kOutOfBounds where a slot lies outside [0, num_slots) (that token skipped).
template <typename T>
int write_kv(T* k_cache, T* v_cache, const T* key, int64_t k_stride, const T* value,
             int64_t v_stride, const int64_t* slots, int64_t num_tokens, int64_t row,
             int64_t num_slots) {
  const bool ok = for_each_slot(slots, num_tokens, num_slots, [&](int64_t t) {
    std::memcpy(k_cache + slots[t] * row, key + t * k_stride, row * sizeof(T));
    std::memcpy(v_cache + slots[t] * row, value + t * v_stride, row * sizeof(T));
  });
  return ok ? 1 : kOutOfBounds;
}

}  // namespace
}  // namespace pagellm

using namespace pagellm;

extern "C" {

// Whether pagellm_paged_attention takes this shape: positive sizes, the query heads whole
// groups of the kv heads (dtype codes: 0 = float32, 1 = bfloat16).
int pagellm_paged_attention_supported(int dtype, int64_t num_heads, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t block_size) {
  return (dtype == 0 || dtype == 1) &&
         attention_shape_ok(num_heads, num_kv_heads, head_dim, block_size);
}

// Paged decode attention with a sliding window (0: none) and a logit soft-cap (0: none); either
// takes the vector path (AMX takes neither). Returns 0, doing nothing, where
// pagellm_paged_attention_supported is 0 or the window or cap is negative; kOutOfBounds where an
// item's query row, block-table row, length or a block id lies outside `bounds` (num_blocks,
// bt_rows, bt_width, rows): that item is skipped, nothing outside is read.
int pagellm_paged_attention_windowed(int dtype, void* out, int64_t out_stride, const void* q,
                                     int64_t q_stride, const int64_t* token_rows,
                                     const void* k_cache, const void* v_cache,
                                     const int32_t* block_tables, int64_t bt_stride,
                                     const int32_t* item_lens, const int64_t* item_bt_rows,
                                     int64_t num_items, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t block_size, float scale,
                                     int64_t sliding_window, float soft_cap,
                                     const CacheBounds* bounds) {
  if (!pagellm_paged_attention_supported(dtype, num_heads, num_kv_heads, head_dim, block_size) ||
      sliding_window < 0 || soft_cap < 0.f)
    return 0;
  if (dtype == 0)
    return paged_attention<F32>(
        static_cast<float*>(out), out_stride, static_cast<const float*>(q), q_stride, token_rows,
        static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), block_tables,
        bt_stride, item_lens, item_bt_rows, num_items,
        DecodePlan<F32>(num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window,
                        soft_cap),
        *bounds);
  return paged_attention<BF16>(
      static_cast<uint16_t*>(out), out_stride, static_cast<const uint16_t*>(q), q_stride,
      token_rows, static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache),
      block_tables, bt_stride, item_lens, item_bt_rows, num_items,
      DecodePlan<BF16>(num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window,
                       soft_cap),
      *bounds);
}

// pagellm_paged_attention_windowed without a window or cap (the AMX path where it fits).
int pagellm_paged_attention(int dtype, void* out, int64_t out_stride, const void* q,
                            int64_t q_stride, const int64_t* token_rows, const void* k_cache,
                            const void* v_cache, const int32_t* block_tables, int64_t bt_stride,
                            const int32_t* item_lens, const int64_t* item_bt_rows,
                            int64_t num_items, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale,
                            const CacheBounds* bounds) {
  return pagellm_paged_attention_windowed(
      dtype, out, out_stride, q, q_stride, token_rows, k_cache, v_cache, block_tables,
      bt_stride, item_lens, item_bt_rows, num_items, num_heads, num_kv_heads, head_dim,
      block_size, scale, /*sliding_window=*/0, /*soft_cap=*/0.f, bounds);
}

// The prefetch slicing a paged_attention call of this shape uses, for tests: out[0..5] =
// (lines, lines per slice) of the per-tile, per-head and per-kv-head slices. Returns 0 where
// the shape is refused.
int pagellm_paged_attention_slices(int dtype, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, int64_t block_size, int64_t* out) {
  if (!pagellm_paged_attention_supported(dtype, num_heads, num_kv_heads, head_dim, block_size))
    return 0;
  const int64_t bytes = block_size * num_kv_heads * head_dim * (dtype == 0 ? 4 : 2);
  const BlockSlices s(bytes, block_size, num_heads, num_kv_heads);
  const PrefetchSlices* all[3] = {&s.per_tile, &s.per_head, &s.per_kv_head};
  for (int i = 0; i < 3; ++i) {
    out[2 * i] = all[i]->lines;
    out[2 * i + 1] = all[i]->per;
  }
  return 1;
}

// Returns 1, or kOutOfBounds where a slot lies outside [0, num_slots) (that token not written).
int pagellm_write_kv(int dtype, void* k_cache, void* v_cache, const void* key, int64_t k_stride,
                     const void* value, int64_t v_stride, const int64_t* slots,
                     int64_t num_tokens, int64_t row, int64_t num_slots) {
  if (dtype == 0)
    return write_kv(static_cast<float*>(k_cache), static_cast<float*>(v_cache),
                    static_cast<const float*>(key), k_stride, static_cast<const float*>(value),
                    v_stride, slots, num_tokens, row, num_slots);
  return write_kv(static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache),
                  static_cast<const uint16_t*>(key), k_stride,
                  static_cast<const uint16_t*>(value), v_stride, slots, num_tokens, row,
                  num_slots);
}

}  // extern "C"
