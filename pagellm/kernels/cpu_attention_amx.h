// The AMX building blocks of decode attention (cpu_attention.cpp): the scores of every query
// head against 16 K rows as tile products, and the column-wise softmax of those scores.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_amx.h"
#include "cpu_common.h"

namespace pagellm {
namespace {

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
}  // namespace
}  // namespace pagellm
