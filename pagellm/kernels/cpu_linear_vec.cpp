// Linear layers with AVX-512 vectors, y = x W^T (+ bias), for machines without AMX tiles
// (bfloat16, with AVX512-BF16 dot products) and for float32 (FMAs), on weights packed once at
// load time.
//
// Packed layout: the weight's output rows in blocks of 16, each block [K/2][16][2] (bfloat16:
// the dot-product operand, 16 outputs x an input dim pair) or [K][16] (float32), blocks one
// after another: the same size as the plain [N, K] weight. The micro-kernel is the outer-product
// form of a GEMM: MR rows of x x NR blocks of 16 outputs in MR * NR float32 accumulators held in
// registers over all of K, one broadcast input element (pair) per row meeting NR weight vectors
// per step, so each step is NR loads and MR broadcasts for MR * NR fused products and the
// results are stored as they are, 16 outputs at once. Each thread takes its own panels of NR
// blocks (its weights stream from memory once per 256 rows of x; a panel stays in L2 while every
// row group of x runs past it). Meanwhile the thread's next panel is prefetched into L2, each
// row group a slice of it spread over its k steps: with a few row groups (decode batches of
// 16-64 rows) the weights would otherwise arrive on demand from memory, the first row group
// waiting on them. Sums are float32; outputs are rounded to the dtype once.
//
// With one or two rows of x (batch-1 decode, small batches) the product is the weight stream
// and little else: there each thread reads its own contiguous range of blocks front to back,
// one block at a time (one sequential stream per thread; on the 2 MiB pages the packed copy
// gets (huge_pages.py) that streams at the memory's read speed, where NR streams side by side
// lose 5-15%). Measurements: docs/performance.md.
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "cpu_entry_points.h"

namespace pagellm {
namespace {

#if defined(__AVX512F__)
constexpr int kMR = 8;  // rows of x per micro-kernel (the most: 8 x 3 accumulators)
constexpr int kNR = 3;  // blocks of 16 outputs per micro-kernel
constexpr int64_t kRowChunk = 256;  // rows of x kept in L2 while the weight panels stream past

// Cache lines to prefetch into L2 during one micro-kernel call, one per k step from `at`
// (`step` bytes apart) until `end`.
struct StepPrefetch {
  const char* at = nullptr;
  const char* end = nullptr;
  int64_t step = 64;
};

// y rows [m0, m0 + MR) x outputs of blocks [nb, nb + NR).
template <typename T, int MR, int NR>
inline void micro(T* y, int64_t ldy, const T* x, int64_t lda, const T* wp, const T* bias,
                  int64_t K, int64_t m0, int64_t nb, StepPrefetch pf) {
  using Ops = VecOps<T>;
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t block = K * 16;  // elements per packed block
  const T* w0 = wp + nb * block;
  const T* xr = x + m0 * lda;
  for (int64_t k = 0; k < K; k += Ops::kPer) {
    if (pf.at < pf.end) {
      __builtin_prefetch(pf.at, 0, 2);
      pf.at += pf.step;
    }
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Ops::load(w0 + j * block + k * 16);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = Ops::bcast(xr + i * lda + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = Ops::madd(acc[i][j], wv[j], xv);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t n = (nb + j) * 16;
    const __m512 b = bias ? load16(bias + n) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) store16(y + (m0 + i) * ldy + n, _mm512_add_ps(acc[i][j], b));
  }
}

// All rows of one chunk against NR blocks from nb: groups of kMR rows, then the leftover rows;
// row group g prefetches slice g of the `next_elems` elements at `next` (none if null).
template <typename T, int NR>
void panel(T* y, int64_t ldy, const T* x, int64_t lda, const T* wp, const T* bias, int64_t K,
           int64_t m0, int64_t m1, int64_t nb, const T* next, int64_t next_elems) {
  const int64_t groups = (m1 - m0 + kMR - 1) / kMR;
  const int64_t bytes = next == nullptr ? 0 : next_elems * static_cast<int64_t>(sizeof(T));
  const int64_t slice = (bytes / std::max<int64_t>(groups, 1) + 63) / 64 * 64;
  const int64_t steps = std::max<int64_t>(K / VecOps<T>::kPer, 1);
  const int64_t step = std::max<int64_t>(64, (slice / steps + 63) / 64 * 64);
  const char* base = reinterpret_cast<const char*>(next);
  auto slice_of = [&](int64_t g) {  // empty (at == end) where there is no next panel
    return StepPrefetch{base + std::min(bytes, g * slice),
                        base + std::min(bytes, (g + 1) * slice), step};
  };
  int64_t m = m0, g = 0;
  for (; m + kMR <= m1; m += kMR, ++g)
    micro<T, kMR, NR>(y, ldy, x, lda, wp, bias, K, m, nb, slice_of(g));
  const StepPrefetch pf = slice_of(g);
  switch (m1 - m) {
    case 7: micro<T, 7, NR>(y, ldy, x, lda, wp, bias, K, m, nb, pf); break;
    case 6: micro<T, 6, NR>(y, ldy, x, lda, wp, bias, K, m, nb, pf); break;
    case 5: micro<T, 5, NR>(y, ldy, x, lda, wp, bias, K, m, nb, pf); break;
    case 4: micro<T, 4, NR>(y, ldy, x, lda, wp, bias, K, m, nb, pf); break;
    case 3: micro<T, 3, NR>(y, ldy, x, lda, wp, bias, K, m, nb, pf); break;
    case 2: micro<T, 2, NR>(y, ldy, x, lda, wp, bias, K, m, nb, pf); break;
    case 1: micro<T, 1, NR>(y, ldy, x, lda, wp, bias, K, m, nb, pf); break;
    default: break;
  }
}

constexpr int64_t kStreamRows = 2;  // up to this many rows of x: the streaming path

// y rows [0, MR) x the 16 outputs of block nb, block by block for nb in [nb0, nb1): MR rows
// of x against one weight stream. One bfloat16 row sums even and odd k pair steps apart (two
// chains: one chain of dot products, ~6 cycles each, would cap a core below its memory speed);
// float32 FMAs are quick enough in one chain, which keeps every row's summation order that of
// the many-row path (float32 results do not depend on the batch's size).
template <typename T, int MR>
void stream_blocks(T* y, int64_t ldy, const T* x, int64_t lda, const T* wp, const T* bias,
                   int64_t K, int64_t nb0, int64_t nb1) {
  using Ops = VecOps<T>;
  constexpr int64_t step = Ops::kPer;
  constexpr int U = MR == 1 && step == 2 ? 2 : 1;  // independent accumulators per row
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    __m512 acc[U][MR];
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < MR; ++i) acc[u][i] = _mm512_setzero_ps();
    const T* w = wp + nb * K * 16;
    int64_t k = 0;
    for (; k + U * step <= K; k += U * step)
      for (int u = 0; u < U; ++u) {
        const __m512 wv = Ops::load(w + (k + u * step) * 16);
        for (int i = 0; i < MR; ++i)
          acc[u][i] = Ops::madd(acc[u][i], wv, Ops::bcast(x + i * lda + k + u * step));
      }
    for (; k < K; k += step) {
      const __m512 wv = Ops::load(w + k * 16);
      for (int i = 0; i < MR; ++i)
        acc[0][i] = Ops::madd(acc[0][i], wv, Ops::bcast(x + i * lda + k));
    }
    const int64_t n = nb * 16;
    const __m512 b = bias ? load16(bias + n) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      __m512 sum = acc[0][i];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][i]);
      store16(y + i * ldy + n, _mm512_add_ps(sum, b));
    }
  }
}

template <typename T>
void gemm(T* y, int64_t ldy, const T* x, int64_t lda, const T* wp, const T* bias, int64_t M,
          int64_t N, int64_t K) {
  const int64_t NB = N / 16, panels = (NB + kNR - 1) / kNR;
  if (M <= 0) return;
  if (M <= kStreamRows) {
#pragma omp parallel
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t nb0 = NB * t / nt, nb1 = NB * (t + 1) / nt;
      if (M == 2) stream_blocks<T, 2>(y, ldy, x, lda, wp, bias, K, nb0, nb1);
      else stream_blocks<T, 1>(y, ldy, x, lda, wp, bias, K, nb0, nb1);
    }
    return;
  }
#pragma omp parallel
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    for (int64_t mc = 0; mc < M; mc += kRowChunk) {
      const int64_t me = std::min(M, mc + kRowChunk);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t nb = p * kNR, nr = std::min<int64_t>(kNR, NB - nb);
        // This thread's next panel: its blocks follow this one's.
        const int64_t next_nr = p + 1 < p1 ? std::min<int64_t>(kNR, NB - nb - kNR) : 0;
        const T* next = next_nr > 0 ? wp + (nb + kNR) * K * 16 : nullptr;
        const int64_t ne = next_nr * K * 16;
        if (nr == 3) panel<T, 3>(y, ldy, x, lda, wp, bias, K, mc, me, nb, next, ne);
        else if (nr == 2) panel<T, 2>(y, ldy, x, lda, wp, bias, K, mc, me, nb, next, ne);
        else panel<T, 1>(y, ldy, x, lda, wp, bias, K, mc, me, nb, next, ne);
      }
    }
  }
}

// w [N, K] -> the packed blocks (see the top of the file).
template <typename T>
void pack(T* dst, const T* w, int64_t N, int64_t K) {
  constexpr int64_t per = VecOps<T>::kPer;
#pragma omp parallel for
  for (int64_t nb = 0; nb < N / 16; ++nb) {
    T* blk = dst + nb * K * 16;
    for (int64_t k = 0; k < K; k += per)
      for (int64_t n = 0; n < 16; ++n)
        for (int64_t e = 0; e < per; ++e) blk[k * 16 + n * per + e] = w[(nb * 16 + n) * K + k + e];
  }
}
#endif  // __AVX512F__

}  // namespace
}  // namespace pagellm

extern "C" {

// Whether pagellm_linear_packed takes this dtype (0 = float32, 1 = bfloat16) and a weight of N
// outputs and K inputs here: N % 16 == 0 (and K even in bfloat16), AVX-512 (and AVX512-BF16).
int pagellm_linear_packed_available(int dtype, int64_t N, int64_t K) {
  if (N <= 0 || N % 16 != 0 || K <= 0) return 0;
#if defined(__AVX512F__)
  if (dtype == 0) return 1;
#if defined(__AVX512BF16__)
  if (dtype == 1) return K % 2 == 0 ? 1 : 0;
#endif
#endif
  return 0;
}

// dst (N * K elements) = the packed layout of w [N, K] contiguous.
void pagellm_linear_pack(int dtype, void* dst, const void* w, int64_t N, int64_t K) {
  using namespace pagellm;
  if (!pagellm_linear_packed_available(dtype, N, K)) return;
#if defined(__AVX512F__)
  if (dtype == 0) pack(static_cast<float*>(dst), static_cast<const float*>(w), N, K);
#if defined(__AVX512BF16__)
  if (dtype == 1) pack(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(w), N, K);
#endif
#endif
}

// y [M, N] (row stride ldy) = x [M, K] (row stride lda) @ W^T + bias, all of the dtype, W given
// packed (pagellm_linear_pack); bias may be null. Returns 0, doing nothing, where
// pagellm_linear_packed_available is 0.
int pagellm_linear_packed(int dtype, void* y, int64_t ldy, const void* x, int64_t lda,
                          const void* wp, const void* bias, int64_t M, int64_t N, int64_t K) {
  using namespace pagellm;
  if (!pagellm_linear_packed_available(dtype, N, K)) return 0;
#if defined(__AVX512F__)
  if (dtype == 0)
    gemm(static_cast<float*>(y), ldy, static_cast<const float*>(x), lda,
         static_cast<const float*>(wp), static_cast<const float*>(bias), M, N, K);
#if defined(__AVX512BF16__)
  if (dtype == 1)
    gemm(static_cast<uint16_t*>(y), ldy, static_cast<const uint16_t*>(x), lda,
         static_cast<const uint16_t*>(wp), static_cast<const uint16_t*>(bias), M, N, K);
#endif
#endif
  (void)y; (void)ldy; (void)x; (void)lda; (void)wp; (void)bias; (void)M;
  return 1;
}

}  // extern "C"
