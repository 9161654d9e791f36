// bfloat16 linear layers with AMX, y = x W^T (+ bias), on the plain weights [N, K].
//
// The weight is the A operand: a tile is 16 of its rows x 32 input dims, loaded in place (the
// 16 rows are one contiguous span of memory, read once per call). x is the B operand, regrouped
// per call into VNNI tiles of 16 of its rows (a cheap copy: x is small next to W for the row
// counts this serves), so a tile product gives 16 outputs x 16 rows of x, stored transposed.
// With few rows (decode) this streams the weights at memory speed with no packed copy, and the
// same plain tensor still serves torch's matmul for long prefill chunks. Accumulation is
// float32; outputs are rounded to bfloat16 once (as torch's matmuls, in another summation order).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_entry_points.h"

namespace pagellm {
namespace {

#if defined(PAGELLM_AMX)
constexpr int64_t kTile = 512;  // bf16 elements per tile: 16 rows x 64 bytes

// xv[g][kb] = the VNNI tile [16 dim pairs][16 rows][2] of x's rows [16 g, 16 g + 16) and dims
// [32 kb, 32 kb + 32): the transpose of those rows taken as 16 x 16 dim pairs; rows past M
// are zero.
void pack_rows(uint16_t* xv, const uint16_t* x, int64_t lda, int64_t M, int64_t K, int64_t g0,
               int64_t g1) {
  const int64_t KB = K / 32;
  __m512i r[16];
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t kb = 0; kb < KB; ++kb) {
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t m = g * 16 + c;
        r[c] = m < M ? _mm512_loadu_si512(x + m * lda + kb * 32) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint16_t* tile = xv + (g * KB + kb) * kTile;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(tile + i * 32, r[i]);
    }
}

// c [16 outputs][16 rows] float32 (row stride 16) -> y rows [0, rows) x columns
// [n0, n0 + 16), + bias, rounded to bfloat16.
inline void store_transposed(uint16_t* y, int64_t ldy, const float* c, int64_t rows,
                             int64_t n0, const uint16_t* bias) {
  __m512 b = _mm512_setzero_ps();
  if (bias)
    b = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0))), 16));
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + i * 16);
  transpose16(r);
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_castsi512_ps(r[m]), b);
    _mm256_storeu_si256((__m256i*)(y + m * ldy + n0), to_bf16x16(v));
  }
}

// Output blocks nb (, nb + 1) x row groups g (, g + 1): tiles C(i, j) = 2 i + j, A(i) = W rows
// = 4 + i, B(j) = x group = 6 + j. The next weight rows are prefetched as these are consumed.
template <int NI, int GJ>
inline void amx_block(float* c, const uint16_t* w, int64_t ldw, const uint16_t* xv, int64_t KB,
                      const char* next, int64_t next_bytes) {
  const uint16_t* w1 = w + 16 * ldw;
  const uint16_t* x1 = xv + KB * kTile;
  _tile_zero(0);
  if (GJ > 1) _tile_zero(1);
  if (NI > 1) _tile_zero(2);
  if (NI > 1 && GJ > 1) _tile_zero(3);
  // Spread the prefetch of the next block's rows over this block's steps.
  const int64_t lines = next ? next_bytes / 64 : 0;
  const int64_t per_step = (lines + KB - 1) / KB;
  for (int64_t kb = 0; kb < KB; ++kb) {
    for (int64_t l = kb * per_step, e = std::min(lines, l + per_step); l < e; ++l)
      _mm_prefetch(next + l * 64, _MM_HINT_T0);
    _tile_loadd(4, w + kb * 32, ldw * 2);
    _tile_loadd(6, xv + kb * kTile, 64);
    if (GJ > 1) _tile_loadd(7, x1 + kb * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (GJ > 1) _tile_dpbf16ps(1, 4, 7);
    if (NI > 1) {
      _tile_loadd(5, w1 + kb * 32, ldw * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (GJ > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if (GJ > 1) _tile_stored(1, c + 256, 64);
  if (NI > 1) _tile_stored(2, c + 512, 64);
  if (NI > 1 && GJ > 1) _tile_stored(3, c + 768, 64);
}

// Output blocks [nb0, nb1) of all M rows: pairs of weight blocks (32 rows, read once from
// memory) against pairs of row groups (kept in L2 across the weight blocks).
void amx_rows(uint16_t* y, int64_t ldy, const uint16_t* w, const uint16_t* xv,
              const uint16_t* bias, int64_t M, int64_t K, int64_t nb0, int64_t nb1) {
  const int64_t KB = K / 32, G = (M + 15) / 16;
  FullTiles tiles;
  alignas(64) float c[4 * 256];
  for (int64_t nb = nb0; nb < nb1; nb += 2) {
    const bool two = nb + 1 < nb1;
    const uint16_t* wb = w + nb * 16 * K;
    // The next pair of weight blocks is prefetched a slice per row pair, spread over all the
    // row pairs of this one (with many rows, over the last pair alone it would stall).
    const int64_t next_total = nb + 2 < nb1 ? std::min<int64_t>(nb1 - nb - 2, 2) * 16 * K * 2 : 0;
    const int64_t npairs = (G + 1) / 2;
    const int64_t slice = (next_total / 64 + npairs - 1) / npairs * 64;
    for (int64_t g = 0; g < G; g += 2) {
      const bool pair = g + 1 < G;
      const int64_t off = (g / 2) * slice;
      const char* next = off < next_total ? reinterpret_cast<const char*>(wb + 32 * K) + off
                                          : nullptr;
      const int64_t next_bytes = next ? std::min(slice, next_total - off) : 0;
      const uint16_t* xg = xv + g * KB * kTile;
      if (two) {
        if (pair) amx_block<2, 2>(c, wb, K, xg, KB, next, next_bytes);
        else amx_block<2, 1>(c, wb, K, xg, KB, next, next_bytes);
      } else {
        if (pair) amx_block<1, 2>(c, wb, K, xg, KB, next, next_bytes);
        else amx_block<1, 1>(c, wb, K, xg, KB, next, next_bytes);
      }
      for (int j = 0; j < (pair ? 2 : 1); ++j) {
        const int64_t m0 = (g + j) * 16, rows = std::min<int64_t>(16, M - m0);
        store_transposed(y + m0 * ldy, ldy, c + j * 256, rows, nb * 16, bias);
        if (two) store_transposed(y + m0 * ldy, ldy, c + 512 + j * 256, rows, (nb + 1) * 16, bias);
      }
    }
  }
}
#endif

}  // namespace
}  // namespace pagellm

extern "C" {

// Whether pagellm_linear can run here (AMX built in and granted).
int pagellm_linear_available() {
#if defined(PAGELLM_AMX)
  return pagellm::amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// y [M, N] (row stride ldy) = x [M, K] (row stride lda) @ w^T + bias, all bfloat16, w [N, K]
// contiguous; bias may be null. Needs N and K positive, N % 16 == 0 and K % 32 == 0 (the tile
// loops divide by K / 32 and by the row groups). Returns 0, having done nothing, where AMX is
// missing or not granted (pagellm_linear_available() says so first) or the shape is not one of
// those; M == 0 is done at once.
int pagellm_linear(void* y, int64_t ldy, const void* x, int64_t lda, const void* w,
                   const void* bias, int64_t M, int64_t N, int64_t K) {
#if defined(PAGELLM_AMX)
  using namespace pagellm;
  if (!amx_permitted() || N <= 0 || K <= 0 || N % 16 != 0 || K % 32 != 0 || M < 0) return 0;
  if (M == 0) return 1;
  const int64_t G = (M + 15) / 16, NB = N / 16;
  static thread_local std::vector<uint16_t> xv_buf;
  if (xv_buf.size() < static_cast<size_t>(G * 16 * K)) xv_buf.resize(G * 16 * K);
  uint16_t* xv = xv_buf.data();
  const auto* xi = static_cast<const uint16_t*>(x);
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    pack_rows(xv, xi, lda, M, K, G * t / T, G * (t + 1) / T);
#pragma omp barrier
    // Pairs of output blocks per thread.
    const int64_t pairs = (NB + 1) / 2;
    const int64_t nb0 = 2 * (pairs * t / T), nb1 = std::min(NB, 2 * (pairs * (t + 1) / T));
    auto* yo = static_cast<uint16_t*>(y);
    const auto* wi = static_cast<const uint16_t*>(w);
    const auto* bi = static_cast<const uint16_t*>(bias);
    if (nb0 < nb1) {
      amx_rows(yo, ldy, wi, xv, bi, M, K, nb0, nb1);
    }
  }
  return 1;
#else
  (void)y; (void)ldy; (void)x; (void)lda; (void)w; (void)bias; (void)M; (void)N; (void)K;
  return 0;
#endif
}

}  // extern "C"
