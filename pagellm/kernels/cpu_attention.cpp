// Paged attention and KV-cache writes on the CPU, float32 and bfloat16.
//
// Each work item is one query row attending to the first L cached tokens of its sequence: a
// decode token, or one token of a prefill chunk (L = its position + 1) once the chunk's K/V are
// in the cache. Decode is bound by reading K/V from memory, so an item reads every cache row
// (all kv heads of a token, contiguous) once, block by block, with the blocks PF ahead
// prefetched (blocks are scattered, which defeats the hardware prefetcher at each block edge).
// Pass 1 computes the scores of all heads for 16 tokens at a time: with AMX
// (bfloat16, up to 16 heads) as one tile product per (kv head, 32 dims) of the K rows against
// the query group's transposed rows, else with AVX512-BF16 dot products (unrolled for head
// sizes 64 and 128) and a transpose-add tree; pass 2 accumulates V with the accumulators of a
// kv head's query group held in registers: on the bfloat16 vector path as dot products of two
// tokens' V rows interleaved against the pair of their weights rounded to bfloat16 (2.3x fewer
// instructions than FMAs on converted V), else float32 FMAs. Softmax and accumulation are
// float32. Plain loops where the machine has neither.

#include <algorithm>
#include <memory>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"

namespace pagellm {
namespace {

// How many blocks ahead K/V are prefetched.
constexpr int64_t PF = 2;

// A block's cache lines split into `parts` slices, prefetched one slice at a time: spreads a
// block's prefetches over the compute of the block before it (a burst of them fills the
// line-fill buffers and stalls). The division is done once per call, not per slice.
struct PrefetchSlices {
  int64_t lines, per;
  PrefetchSlices(int64_t bytes, int64_t parts)
      : lines((bytes + 63) / 64), per(((bytes + 63) / 64 + parts - 1) / parts) {}
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
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

#if defined(__AVX512F__)
// ---------------------------------------------------------------- AVX-512 building blocks
// Unreduced q . k: sum the lanes to get the dot product.
inline __m512 dot_lanes(const float* q, const float* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(load16(q + d), load16(k + d), acc);
  return acc;
}

inline __m512 dot_lanes(const uint16_t* q, const uint16_t* k, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if (D % 32 == 0) {
    for (int64_t d = 0; d < D; d += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                             (__m512bh)_mm512_loadu_si512(k + d));
    return acc;
  }
#endif
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(load16(q + d), load16(k + d), acc);
  return acc;
}

// acc[g][:] += p[g * pg + j * pj] * v_j for the n tokens of a block; G x DC accumulators in
// registers.
template <typename T, int G, int DC>
void accumulate_block(float* acc, const float* p, int64_t pg, int64_t pj, const T* vb,
                      int64_t row, int64_t n) {
  __m512 a[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_loadu_ps(acc + (g * DC + c) * 16);
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load16(vb + j * row + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * pg + j * pj]);
      for (int c = 0; c < DC; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + (g * DC + c) * 16, a[g][c]);
}
#endif

// The dim of V held by accumulator slot k (vector k / 16, lane k % 16) of accumulate_pairs_bf16.
inline int64_t pair_acc_dim(int64_t k) {
  const int64_t c2 = k / 16, lane = k % 16;
  return 32 * (c2 / 2) + 8 * (lane / 4) + 4 * (c2 % 2) + lane % 4;
}

// dst[0, n) = bfloat16 of src, and dst[n] = 0 where n is odd.
inline void to_bf16_row(uint16_t* dst, const float* src, int64_t n) {
  int64_t t = 0;
#if defined(__AVX512F__)
  for (; t + 16 <= n; t += 16) store16(dst + t, _mm512_loadu_ps(src + t));
#endif
  for (; t < n; ++t) dst[t] = f32_to_bf16(src[t]);
  if (n & 1) dst[n] = 0;
}

using PairsFn = void (*)(float*, const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t);

#if defined(__AVX512BF16__)
// bfloat16 V with dot products, two tokens at a time: rows j and j + 1 interleaved into pairs
// (unpacklo/hi of 16-bit elements: 16 dims x 2 tokens a vector), each meeting the broadcast
// pair (p_j, p_j+1) of bfloat16 weights of every head of the group; G x 2 NV accumulators, NV
// = D / 32. The accumulators hold the dims permuted within each 32 (pair_acc_dim); an odd last
// token pairs with zeros.
template <int G, int NV>
void accumulate_pairs_bf16(float* acc, const uint16_t* pb, int64_t pg, const uint16_t* vb,
                           int64_t row, int64_t n) {
  __m512 a[G][2 * NV];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NV; ++c) a[g][c] = _mm512_loadu_ps(acc + (g * 2 * NV + c) * 16);
  for (int64_t j = 0; j < n; j += 2) {
    const bool pair = j + 1 < n;
    __m512i w[2 * NV];
    for (int c = 0; c < NV; ++c) {
      const __m512i v0 = _mm512_loadu_si512(vb + j * row + c * 32);
      const __m512i v1 = pair ? _mm512_loadu_si512(vb + (j + 1) * row + c * 32)
                              : _mm512_setzero_si512();
      w[2 * c] = _mm512_unpacklo_epi16(v0, v1);
      w[2 * c + 1] = _mm512_unpackhi_epi16(v0, v1);
    }
    for (int g = 0; g < G; ++g) {
      int32_t bits;
      if (pair) {
        std::memcpy(&bits, pb + g * pg + j, 4);
      } else {
        bits = pb[g * pg + j];  // (p_j, 0)
      }
      const __m512bh b = (__m512bh)_mm512_set1_epi32(bits);
      for (int c = 0; c < 2 * NV; ++c)
        a[g][c] = _mm512_dpbf16_ps(a[g][c], (__m512bh)w[c], b);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * NV; ++c) _mm512_storeu_ps(acc + (g * 2 * NV + c) * 16, a[g][c]);
}

PairsFn pick_pairs(int64_t G, int64_t D) {
#define PAGELLM_PAIRS_CASE(g)                                  \
  case g:                                                      \
    if (D == 64) return &accumulate_pairs_bf16<g, 2>;          \
    if (D == 128) return &accumulate_pairs_bf16<g, 4>;         \
    break;
  switch (G) {
    PAGELLM_PAIRS_CASE(1)
    PAGELLM_PAIRS_CASE(2)
    PAGELLM_PAIRS_CASE(3)
    PAGELLM_PAIRS_CASE(4)
    PAGELLM_PAIRS_CASE(5)
    PAGELLM_PAIRS_CASE(6)
    PAGELLM_PAIRS_CASE(7)
    PAGELLM_PAIRS_CASE(8)
    default:
      break;
  }
#undef PAGELLM_PAIRS_CASE
  return nullptr;
}
#endif

template <typename T>
void accumulate_block_generic(float* acc, const float* p, int64_t pg, int64_t pj, int64_t G,
                              const T* vb, int64_t row, int64_t n, int64_t D) {
  using C = std::conditional_t<sizeof(T) == 2, BF16, F32>;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) {
      const float x = C::load(vb[j * row + d]);
      for (int64_t g = 0; g < G; ++g) acc[g * D + d] += p[g * pg + j * pj] * x;
    }
}

template <typename T>
using AccumulateFn = void (*)(float*, const float*, int64_t, int64_t, const T*, int64_t,
                              int64_t);

// The register-blocked accumulator for (G, D), or null when none is compiled for it.
template <typename T>
AccumulateFn<T> pick_accumulate(int64_t G, int64_t D) {
#if defined(__AVX512F__)
#define PAGELLM_ACC_CASE(g)                                            \
  case g:                                                              \
    if (D == 64) return &accumulate_block<T, g, 4>;                    \
    if (D == 128) return &accumulate_block<T, g, 8>;                   \
    break;
  switch (G) {
    PAGELLM_ACC_CASE(1)
    PAGELLM_ACC_CASE(2)
    PAGELLM_ACC_CASE(3)
    PAGELLM_ACC_CASE(4)
    PAGELLM_ACC_CASE(5)
    PAGELLM_ACC_CASE(6)
    PAGELLM_ACC_CASE(7)
    PAGELLM_ACC_CASE(8)
    default:
      break;
  }
#undef PAGELLM_ACC_CASE
#endif
  (void)G;
  (void)D;
  return nullptr;
}

// out[j] = scale * q . k_j for the n (<= 16) tokens of one block.
template <typename C>
void block_scores(float* out, const typename C::T* q, const typename C::T* kb, int64_t row,
                  int64_t n, int64_t D, float scale) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && n <= 16) {
    __m512 lanes[16];
    for (int64_t j = 0; j < 16; ++j)
      lanes[j] = j < n ? dot_lanes(q, kb + j * row, D) : _mm512_setzero_ps();
    const __m512 r = _mm512_mul_ps(hsum16(lanes), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1u), r);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) s += C::load(q[d]) * C::load(kb[j * row + d]);
    out[j] = scale * s;
  }
}

#if defined(__AVX512F__)
// block_scores with head_dim = NV vectors (32 dims each in bfloat16, 16 in float32) fixed at
// compile time: q held in registers, the dot products unrolled (VecOps: bfloat16 needs
// AVX512-BF16, pick_scores asks for it).
template <typename C, int NV>
void block_scores_fixed(float* out, const typename C::T* q, const typename C::T* kb, int64_t row,
                        int64_t n, int64_t D, float scale) {
  using T = typename C::T;
  using Ops = VecOps<T>;
  constexpr int64_t W = 16 * Ops::kPer;  // elements per vector
  (void)D;
  __m512 qv[NV];
  for (int c = 0; c < NV; ++c) qv[c] = Ops::load(q + c * W);
  __m512 lanes[16];
  for (int64_t j = 0; j < 16; ++j) {
    __m512 acc = _mm512_setzero_ps();
    if (j < n)
      for (int c = 0; c < NV; ++c) acc = Ops::madd(acc, qv[c], Ops::load(kb + j * row + c * W));
    lanes[j] = acc;
  }
  const __m512 r = _mm512_mul_ps(hsum16(lanes), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1u), r);
}
#endif

template <typename C>
using ScoresFn = void (*)(float*, const typename C::T*, const typename C::T*, int64_t, int64_t,
                          int64_t, float);

// The unrolled scores for head sizes 64 and 128 (bfloat16 needs AVX512-BF16 for them), else the
// general loop.
template <typename C>
ScoresFn<C> pick_scores(int64_t D) {
#if defined(__AVX512F__)
  constexpr bool bf16 = sizeof(typename C::T) == 2;
#if defined(__AVX512BF16__)
  constexpr bool vec = true;
#else
  constexpr bool vec = !bf16;
#endif
  if constexpr (vec) {
    constexpr int64_t W = bf16 ? 32 : 16;
    if (D == 64) return &block_scores_fixed<C, 64 / W>;
    if (D == 128) return &block_scores_fixed<C, 128 / W>;
  }
#endif
  (void)D;
  return &block_scores<C>;
}

// p = exp(s - max(s)) in place; returns 1 / sum(p).
float softmax_unnormalized(float* s, int64_t L) {
  int64_t t = 0;
  float m = -INFINITY, sum = 0.f;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; t + 16 <= L; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
  m = _mm512_reduce_max_ps(vm);
  for (int64_t u = t; u < L; ++u) m = std::max(m, s[u]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 vs = _mm512_setzero_ps();
  for (t = 0; t + 16 <= L; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm512_storeu_ps(s + t, e);
    vs = _mm512_add_ps(vs, e);
  }
  sum = _mm512_reduce_add_ps(vs);
#else
  for (int64_t u = 0; u < L; ++u) m = std::max(m, s[u]);
#endif
  for (; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return 1.f / sum;
}

#if defined(PAGELLM_AMX)
// This thread's tiles (FullTiles): 0 = C: scores [16 tokens x 16 heads] float32, 1 = A: K [16
// tokens x 32 dims], 2..7 = B: q^T [16 dim pairs x 16 heads x 2] (VNNI) of each (kv head, 32
// dims), kept for a whole sequence when they fit (else tile 2, reloaded).

// qt[c][half] (16 x 32 bf16 each) = the VNNI B tile of kv head c's query group for dims
// [32 half, 32 half + 32): column n holds head n's dim pairs when n is in group c, else 0.
void build_query_tiles(uint16_t* qt, const uint16_t* q, int64_t H, int64_t G, int64_t Hkv,
                       int64_t D) {
  const int64_t halves = D / 32;
  std::memset(qt, 0, Hkv * halves * 512 * sizeof(uint16_t));
  for (int64_t n = 0; n < H; ++n) {
    const int64_t c = n / G;
    for (int64_t half = 0; half < halves; ++half) {
      uint16_t* tile = qt + (c * halves + half) * 512;
      const uint16_t* qn = q + n * D + half * 32;
      for (int64_t r = 0; r < 16; ++r) {
        tile[r * 32 + 2 * n] = qn[2 * r];
        tile[r * 32 + 2 * n + 1] = qn[2 * r + 1];
      }
    }
  }
}

// Up to 6 query tiles stay in tiles 2..7 for a whole sequence.
constexpr int64_t kResidentQueryTiles = 6;

inline void load_query_tiles(const uint16_t* qt, int64_t ntiles) {
  if (ntiles > 0) _tile_loadd(2, qt + 0 * 512, 64);
  if (ntiles > 1) _tile_loadd(3, qt + 1 * 512, 64);
  if (ntiles > 2) _tile_loadd(4, qt + 2 * 512, 64);
  if (ntiles > 3) _tile_loadd(5, qt + 3 * 512, 64);
  if (ntiles > 4) _tile_loadd(6, qt + 4 * 512, 64);
  if (ntiles > 5) _tile_loadd(7, qt + 5 * 512, 64);
}

// st[j][n] = q_n . k_j (unscaled) for the 16 token rows of kb, every head n < 16 at once: one
// tile product per (kv head, 32 dims), the other groups' columns of B being zero. With
// ``resident`` the query tiles are already in tiles 2..7.
inline void amx_block_scores(float* st, const uint16_t* kb, int64_t row, const uint16_t* qt,
                             int64_t Hkv, int64_t D, bool resident) {
  const int64_t halves = D / 32;
  _tile_zero(0);
  for (int64_t c = 0; c < Hkv; ++c)
    for (int64_t half = 0; half < halves; ++half) {
      const int64_t i = c * halves + half;
      _tile_loadd(1, kb + c * D + half * 32, row * 2);
      if (!resident) {
        _tile_loadd(2, qt + i * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
        continue;
      }
      switch (i) {
        case 0: _tile_dpbf16ps(0, 1, 2); break;
        case 1: _tile_dpbf16ps(0, 1, 3); break;
        case 2: _tile_dpbf16ps(0, 1, 4); break;
        case 3: _tile_dpbf16ps(0, 1, 5); break;
        case 4: _tile_dpbf16ps(0, 1, 6); break;
        default: _tile_dpbf16ps(0, 1, 7); break;
      }
    }
  _tile_stored(0, st, 64);
}

// Scale, exponentiate and sum st [L][16] column-wise (head n = lane n); inv[n] = 1 / sum.
void softmax_columns(float* st, int64_t L, float scale, float* inv) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < L; ++t) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(st + t * 16), vscale);
    _mm512_storeu_ps(st + t * 16, x);
    vm = _mm512_max_ps(vm, x);
  }
  __m512 vs = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(st + t * 16), vm));
    _mm512_storeu_ps(st + t * 16, e);
    vs = _mm512_add_ps(vs, e);
  }
  _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), vs));
}
#endif

// Whether this call takes the AMX path: bfloat16, all heads in one tile's 16 rows/columns,
// whole 32-dim halves and 16-token blocks.
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

template <typename C>
void paged_attention(typename C::T* out, int64_t out_stride, const typename C::T* q,
                      int64_t q_stride, const int64_t* token_rows, const typename C::T* k_cache,
                      const typename C::T* v_cache, const int32_t* block_tables,
                      int64_t bt_stride, const int32_t* item_lens, const int64_t* item_bt_rows,
                      int64_t num_items, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale) {
  using T = typename C::T;
  const int64_t H = num_heads, Hkv = num_kv_heads, G = H / Hkv, D = head_dim;
  const int64_t row = Hkv * D;  // elements per cache slot
  const int64_t block_elems = block_size * row;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(T));
  const AccumulateFn<T> accumulate = pick_accumulate<T>(G, D);
  const ScoresFn<C> block_scores = pick_scores<C>(D);
  const bool amx = use_amx<C>(H, D, block_size);
  const PrefetchSlices slices_per_tile(block_bytes, block_size / 16);
  const PrefetchSlices slices_per_head(block_bytes, H), slices_per_kv_head(block_bytes, Hkv);
  // bfloat16 on the vector path: P rounded to bfloat16 meets V in dot products, two tokens at
  // a time (2.3x fewer instructions than float32 FMAs on converted V).
  const PairsFn pairs = [&]() -> PairsFn {
#if defined(__AVX512BF16__)
    if constexpr (sizeof(T) == 2)
      if (!amx) return pick_pairs(G, D);
#endif
    return nullptr;
  }();
#pragma omp parallel
  {
    // Scores: [head][token] on the vector path, [token][16 lanes = heads] on the AMX path.
    // inv: one per head, and 16 lanes at once on the AMX path.
    std::vector<float> acc(H * D), scores, inv(std::max<int64_t>(H, 16));
    std::vector<uint16_t> qt, pbuf;
#if defined(PAGELLM_AMX)
    std::unique_ptr<FullTiles> tiles;
    if (amx) {
      tiles = std::make_unique<FullTiles>();
      qt.resize(Hkv * (D / 32) * 512);
    }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t L = item_lens[item];
      const int64_t nblocks = (L + block_size - 1) / block_size;
      const int32_t* bt = block_tables + item_bt_rows[item] * bt_stride;
      const T* qrow = q + token_rows[item] * q_stride;
      for (int64_t b = 0; b < std::min<int64_t>(PF, nblocks); ++b)
        prefetch_bytes(k_cache + bt[b] * block_elems, block_bytes);
      // Pass 1: every head's scores, 16 tokens at a time, the block PF ahead prefetched
      // piece by piece; then the softmax numerators and 1 / their sums.
      int64_t pg = L, pj = 1;  // where p[head g][token j] lies in scores
      if (amx) {
#if defined(PAGELLM_AMX)
        scores.resize(nblocks * block_size * 16);
        build_query_tiles(qt.data(), reinterpret_cast<const uint16_t*>(qrow), H, G, Hkv, D);
        const int64_t nqt = Hkv * (D / 32);
        const bool resident = nqt <= kResidentQueryTiles;
        if (resident) load_query_tiles(qt.data(), nqt);
        for (int64_t b = 0; b < nblocks; ++b) {
          const T* kb = k_cache + bt[b] * block_elems;
          const T* kn = b + PF < nblocks ? k_cache + bt[b + PF] * block_elems : nullptr;
          for (int64_t j0 = 0; j0 < block_size && b * block_size + j0 < L; j0 += 16) {
            if (kn != nullptr) slices_per_tile(kn, j0 / 16);
            amx_block_scores(scores.data() + (b * block_size + j0) * 16,
                             reinterpret_cast<const uint16_t*>(kb + j0 * row), row, qt.data(),
                             Hkv, D, resident);
          }
        }
        softmax_columns(scores.data(), L, scale, inv.data());
        pg = 1;
        pj = 16;
#endif
      } else {
        scores.resize(H * L);
        for (int64_t b = 0; b < nblocks; ++b) {
          const T* kb = k_cache + bt[b] * block_elems;
          const T* kn = b + PF < nblocks ? k_cache + bt[b + PF] * block_elems : nullptr;
          // This block's V goes to L2 meanwhile, for pass 2 (more misses in flight: the scores
          // pass 0.88-0.96x the time with blocks scattered over a pool far larger than L3).
          const T* vl2 = v_cache + bt[b] * block_elems;
          const int64_t t0 = b * block_size;
          const int64_t n = std::min(L - t0, block_size);
          for (int64_t j0 = 0; j0 < n; j0 += 16)
            for (int64_t h = 0; h < H; ++h) {
              if (kn != nullptr && j0 == 0) slices_per_head(kn, h);
              if (j0 == 0) slices_per_head.to_l2(vl2, h);
              block_scores(scores.data() + h * L + t0 + j0, qrow + h * D,
                              kb + j0 * row + (h / G) * D, row, std::min<int64_t>(16, n - j0), D,
                              scale);
            }
        }
        for (int64_t h = 0; h < H; ++h) inv[h] = softmax_unnormalized(scores.data() + h * L, L);
      }
      // Pass 2: acc[h] = sum_t p[h][t] * v_t
      for (int64_t b = 0; b < std::min<int64_t>(PF, nblocks); ++b)
        prefetch_bytes(v_cache + bt[b] * block_elems, block_bytes);
      std::fill(acc.begin(), acc.end(), 0.f);
      // p as bfloat16 [head][token] (row length even) where the pairs serve.
      const int64_t Lp = L + (L & 1);
      if (pairs != nullptr) {
        pbuf.resize(H * Lp);
        for (int64_t h = 0; h < H; ++h)
          to_bf16_row(pbuf.data() + h * Lp, scores.data() + h * L, L);
      }
      for (int64_t b = 0; b < nblocks; ++b) {
        const T* vb = v_cache + bt[b] * block_elems;
        const T* vn = b + PF < nblocks ? v_cache + bt[b + PF] * block_elems : nullptr;
        const int64_t t0 = b * block_size;
        const int64_t n = std::min(L - t0, block_size);
        for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
          if (vn != nullptr) slices_per_kv_head(vn, kvh);
          float* a = acc.data() + kvh * G * D;
          const float* p = scores.data() + kvh * G * pg + t0 * pj;
          if (pairs != nullptr)
            pairs(a, pbuf.data() + kvh * G * Lp + t0, Lp,
                  reinterpret_cast<const uint16_t*>(vb + kvh * D), row, n);
          else if (accumulate != nullptr)
            accumulate(a, p, pg, pj, vb + kvh * D, row, n);
          else
            accumulate_block_generic(a, p, pg, pj, G, vb + kvh * D, row, n, D);
        }
      }
      // The pairs' accumulators hold the dims permuted (pair_acc_dim).
      T* orow = out + token_rows[item] * out_stride;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t k = 0; k < D; ++k)
          orow[h * D + (pairs != nullptr ? pair_acc_dim(k) : k)] =
              C::store(acc[h * D + k] * inv[h]);
    }
  }
}

template <typename T>
void write_kv(T* k_cache, T* v_cache, const T* key, int64_t k_stride, const T* value,
              int64_t v_stride, const int64_t* slots, int64_t num_tokens, int64_t row) {
#pragma omp parallel for if (num_tokens > 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(k_cache + slots[t] * row, key + t * k_stride, row * sizeof(T));
    std::memcpy(v_cache + slots[t] * row, value + t * v_stride, row * sizeof(T));
  }
}

}  // namespace
}  // namespace pagellm

using namespace pagellm;

extern "C" {

// dtype codes: 0 = float32, 1 = bfloat16
void pagellm_paged_attention(int dtype, void* out, int64_t out_stride, const void* q,
                              int64_t q_stride, const int64_t* token_rows, const void* k_cache,
                              const void* v_cache, const int32_t* block_tables, int64_t bt_stride,
                              const int32_t* item_lens, const int64_t* item_bt_rows,
                              int64_t num_items,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale) {
  if (dtype == 0)
    paged_attention<F32>(static_cast<float*>(out), out_stride, static_cast<const float*>(q),
                          q_stride, token_rows, static_cast<const float*>(k_cache),
                          static_cast<const float*>(v_cache), block_tables, bt_stride, item_lens,
                          item_bt_rows, num_items, num_heads, num_kv_heads, head_dim, block_size,
                          scale);
  else
    paged_attention<BF16>(static_cast<uint16_t*>(out), out_stride,
                           static_cast<const uint16_t*>(q), q_stride, token_rows,
                           static_cast<const uint16_t*>(k_cache),
                           static_cast<const uint16_t*>(v_cache), block_tables, bt_stride,
                           item_lens, item_bt_rows, num_items, num_heads, num_kv_heads, head_dim,
                           block_size, scale);
}

void pagellm_write_kv(int dtype, void* k_cache, void* v_cache, const void* key, int64_t k_stride,
                      const void* value, int64_t v_stride, const int64_t* slots,
                      int64_t num_tokens, int64_t row) {
  if (dtype == 0)
    write_kv(static_cast<float*>(k_cache), static_cast<float*>(v_cache),
             static_cast<const float*>(key), k_stride, static_cast<const float*>(value), v_stride,
             slots, num_tokens, row);
  else
    write_kv(static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache),
             static_cast<const uint16_t*>(key), k_stride, static_cast<const uint16_t*>(value),
             v_stride, slots, num_tokens, row);
}

}  // extern "C"
