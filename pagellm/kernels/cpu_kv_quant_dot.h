// The decode kernels' dot-product variants for bfloat16 queries (cpu_kv_quant_vec.h picks them):
// half the multiply-adds of its float32 FMAs, the conversions the same.
// - fp8 (AVX512-BF16): K rows' raw values rounded to bfloat16 (exact: at most 4 significant
//   bits) against the query's bfloat16 pairs; V rows of two tokens interleaved into bfloat16
//   pairs against the weights rounded to bfloat16 pairs (as bf16 decode's P.V);
// - int8 (AVX512-VNNI): the query as int16 with a per-head scale, K rows sign-extended to int16,
//   vpdpwssd (exact int32 sums); the weights (times the V scales) as int16 with a per-head
//   scale against two tokens' V rows interleaved as int16 pairs, int32 sums per block.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"
#include "cpu_kv_quant.h"

namespace pagellm {
namespace {

#if defined(__AVX512BF16__)
// quant_scores for bfloat16 queries: each K row's raw values rounded (exactly: they have at
// most 8 significant bits) to bfloat16 and met by the query's own bfloat16 pairs with dot
// products (half the FMAs); the scale comes after the sums. q: the row's [H][D] bfloat16.
template <int FMT, int G, int NV>
void quant_scores_bf16(const QuantPlan& P, const QuantRow& r, const void* qv, const float*,
                       float* scores) {
  constexpr int64_t D = NV * 16;
  const uint16_t* q = static_cast<const uint16_t*>(qv);
  alignas(64) float lanes[G * 256];
  alignas(64) float ks[16];
  const int64_t bs = P.block_size, block_bytes = bs * P.Hkv * D;
  const __m512 qf = _mm512_set1_ps(P.scale * P.tensor_factor(false));
  for (int64_t b = 0; b < r.nblocks; ++b) {
    const int64_t blk = r.bt[b], t0 = b * bs, n = std::min(bs, r.L - t0);
    if (b + kQuantPF < r.nblocks)
      prefetch_l2(P.k_cache + r.bt[b + kQuantPF] * block_bytes, block_bytes);
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
      __m512bh qb[G][NV / 2];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV / 2; ++c)
          qb[g][c] = (__m512bh)_mm512_loadu_si512(q + (kvh * G + g) * D + 32 * c);
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - j0);
        const int64_t slot0 = blk * bs + j0;
        for (int64_t j = 0; j < m; ++j) {
          const uint8_t* kr = P.k_cache + ((slot0 + j) * P.Hkv + kvh) * D;
          __m512bh k[NV / 2];
          for (int c = 0; c < NV / 2; ++c) {
            __m512 lo, hi;
            raw32<FMT>(kr + 32 * c, lo, hi);
            k[c] = _mm512_cvtne2ps_pbh(hi, lo);
          }
          for (int g = 0; g < G; ++g) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < NV / 2; ++c) a = _mm512_dpbf16_ps(a, k[c], qb[g][c]);
            _mm512_store_ps(lanes + (g * 16 + j) * 16, a);
          }
        }
        const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1u);
        __m512 f = qf;
        if constexpr (FMT == kInt8) {
          for (int64_t j = 0; j < m; ++j)
            ks[j] = bf16_to_f32(P.k_scales[(slot0 + j) * P.Hkv + kvh]);
          f = _mm512_mul_ps(f, _mm512_maskz_loadu_ps(mask, ks));
        }
        for (int g = 0; g < G; ++g)
          _mm512_mask_storeu_ps(scores + (kvh * G + g) * r.L + t0 + j0, mask,
                                _mm512_mul_ps(hsum16(reinterpret_cast<const __m512*>(
                                                  lanes + g * 256)),
                                              f));
      }
    }
  }
}

// quant_pv for bfloat16 weights p ([H][ps], ps even, as bf16 decode's pairs): two tokens' V
// rows at a time, their raw values (exact in bfloat16) interleaved into pairs, dot products
// against the pair of weights of every head of the group.
template <int FMT, int G, int NC>
void quant_pv_bf16(const QuantPlan& P, const QuantRow& r, const void* pv, int64_t ps,
                   const float*, float* acc) {
  const uint16_t* p = static_cast<const uint16_t*>(pv);
  const int64_t D = P.D, bs = P.block_size, block_bytes = bs * P.Hkv * D;
  for (int64_t b = 0; b < std::min(kQuantPF, r.nblocks); ++b)
    prefetch_l2(P.v_cache + r.bt[b] * block_bytes, block_bytes);
  constexpr __mmask32 odd = 0xAAAAAAAAu;
  for (int64_t b = 0; b < r.nblocks; ++b) {
    const int64_t blk = r.bt[b], t0 = b * bs, n = std::min(bs, r.L - t0);
    const int64_t j_first = b == 0 ? r.skip : 0;  // keys before the window: not read
    if (b + kQuantPF < r.nblocks)
      prefetch_l2(P.v_cache + r.bt[b + kQuantPF] * block_bytes, block_bytes);
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
      const uint16_t* pg = p + kvh * G * ps + t0;
      for (int64_t d0 = 0; d0 < D; d0 += NC * 16) {
        __m512 a[G][NC];
        float* ag = acc + kvh * G * D + d0;
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(ag + g * D + 16 * c);
        for (int64_t j = j_first; j < n; j += 2) {
          const bool pair = j + 1 < n;
          const uint8_t* v0 = P.v_cache + ((blk * bs + j) * P.Hkv + kvh) * D + d0;
          __m512i w[NC];
          for (int c = 0; c < NC; c += 2) {
            __m512 x0, x1, y0 = _mm512_setzero_ps(), y1 = _mm512_setzero_ps();
            raw32<FMT>(v0 + 16 * c, x0, x1);
            if (pair) raw32<FMT>(v0 + P.Hkv * D + 16 * c, y0, y1);
            w[c] = _mm512_mask_blend_epi16(odd, _mm512_srli_epi32(_mm512_castps_si512(x0), 16),
                                           _mm512_castps_si512(y0));
            w[c + 1] = _mm512_mask_blend_epi16(odd, _mm512_srli_epi32(_mm512_castps_si512(x1), 16),
                                               _mm512_castps_si512(y1));
          }
          for (int g = 0; g < G; ++g) {
            int32_t bits = pg[g * ps + j];
            if (pair) std::memcpy(&bits, pg + g * ps + j, 4);
            const __m512bh wp = (__m512bh)_mm512_set1_epi32(bits);
            for (int c = 0; c < NC; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], (__m512bh)w[c], wp);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(ag + g * D + 16 * c, a[g][c]);
      }
    }
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// The dim of V an accumulator slot k of quant_pv_i8 holds (vector k / 16, lane k % 16): its
// pairs come from 16-bit unpacks, within each 32 dims.
inline int64_t quant_pair_dim(int64_t k) {
  const int64_t c2 = k / 16, lane = k % 16;
  return 32 * (c2 / 2) + 8 * (lane / 4) + 4 * (c2 % 2) + lane % 4;
}

// int8 with bfloat16 queries, integer dot products: the query as int16 (qs[h]: its scale, the
// softmax scale folded in), each K row sign-extended to int16 (vpdpwssd: int32 sums exact).
template <int G, int NV>
void quant_scores_i8(const QuantPlan& P, const QuantRow& r, const void* qv, const float* qs,
                     float* scores) {
  constexpr int64_t D = NV * 16;
  const int16_t* q = static_cast<const int16_t*>(qv);
  alignas(64) float lanes[G * 256];
  alignas(64) float ks[16];
  const int64_t bs = P.block_size, block_bytes = bs * P.Hkv * D;
  for (int64_t b = 0; b < r.nblocks; ++b) {
    const int64_t blk = r.bt[b], t0 = b * bs, n = std::min(bs, r.L - t0);
    if (b + kQuantPF < r.nblocks)
      prefetch_l2(P.k_cache + r.bt[b + kQuantPF] * block_bytes, block_bytes);
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
      __m512i qi[G][NV / 2];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV / 2; ++c)
          qi[g][c] = _mm512_loadu_si512(q + (kvh * G + g) * D + 32 * c);
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - j0);
        const int64_t slot0 = blk * bs + j0;
        for (int64_t j = 0; j < m; ++j) {
          const uint8_t* kr = P.k_cache + ((slot0 + j) * P.Hkv + kvh) * D;
          __m512i k[NV / 2];
          for (int c = 0; c < NV / 2; ++c)
            k[c] = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kr + 32 * c)));
          for (int g = 0; g < G; ++g) {
            __m512i a = _mm512_setzero_si512();
            for (int c = 0; c < NV / 2; ++c) a = _mm512_dpwssd_epi32(a, k[c], qi[g][c]);
            _mm512_store_ps(lanes + (g * 16 + j) * 16, _mm512_cvtepi32_ps(a));
          }
        }
        const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1u);
        for (int64_t j = 0; j < m; ++j) ks[j] = bf16_to_f32(P.k_scales[(slot0 + j) * P.Hkv + kvh]);
        const __m512 kv = _mm512_maskz_loadu_ps(mask, ks);
        for (int g = 0; g < G; ++g)
          _mm512_mask_storeu_ps(
              scores + (kvh * G + g) * r.L + t0 + j0, mask,
              _mm512_mul_ps(hsum16(reinterpret_cast<const __m512*>(lanes + g * 256)),
                            _mm512_mul_ps(kv, _mm512_set1_ps(qs[kvh * G + g]))));
      }
    }
  }
}

// int8 P.V with int16 weight pairs ([H][ps], ps even; ws[h]: their scale): two tokens' V rows
// sign-extended and interleaved as int16 pairs, vpdpwssd into int32 sums per block (exact:
// |w| <= 32767, |v| <= 127, a block <= 128 tokens), then into the float32 accumulators (the
// dims permuted within each 32: quant_pair_dim).
template <int G, int NC>
void quant_pv_i8(const QuantPlan& P, const QuantRow& r, const void* pv, int64_t ps,
                 const float* ws, float* acc) {
  const int16_t* p = static_cast<const int16_t*>(pv);
  const int64_t D = P.D, bs = P.block_size, block_bytes = bs * P.Hkv * D;
  for (int64_t b = 0; b < std::min(kQuantPF, r.nblocks); ++b)
    prefetch_l2(P.v_cache + r.bt[b] * block_bytes, block_bytes);
  for (int64_t b = 0; b < r.nblocks; ++b) {
    const int64_t blk = r.bt[b], t0 = b * bs, n = std::min(bs, r.L - t0);
    const int64_t j_first = b == 0 ? r.skip : 0;  // keys before the window: not read
    if (b + kQuantPF < r.nblocks)
      prefetch_l2(P.v_cache + r.bt[b + kQuantPF] * block_bytes, block_bytes);
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
      const int16_t* pg = p + kvh * G * ps + t0;
      for (int64_t d0 = 0; d0 < D; d0 += NC * 16) {
        __m512i a[G][NC];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < NC; ++c) a[g][c] = _mm512_setzero_si512();
        for (int64_t j = j_first; j < n; j += 2) {
          const bool pair = j + 1 < n;
          const uint8_t* v0 = P.v_cache + ((blk * bs + j) * P.Hkv + kvh) * D + d0;
          __m512i w[NC];
          for (int c = 0; c < NC; c += 2) {
            const __m512i x = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)));
            const __m512i y = pair ? _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(v0 + P.Hkv * D + 16 * c)))
                                   : _mm512_setzero_si512();
            w[c] = _mm512_unpacklo_epi16(x, y);
            w[c + 1] = _mm512_unpackhi_epi16(x, y);
          }
          for (int g = 0; g < G; ++g) {
            int32_t bits = static_cast<uint16_t>(pg[g * ps + j]);
            if (pair) std::memcpy(&bits, pg + g * ps + j, 4);
            const __m512i wp = _mm512_set1_epi32(bits);
            for (int c = 0; c < NC; ++c) a[g][c] = _mm512_dpwssd_epi32(a[g][c], w[c], wp);
          }
        }
        float* ag = acc + kvh * G * D + d0;
        for (int g = 0; g < G; ++g) {
          const __m512 f = _mm512_set1_ps(ws[kvh * G + g]);
          for (int c = 0; c < NC; ++c)
            _mm512_storeu_ps(ag + g * D + 16 * c,
                             _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[g][c]), f,
                                             _mm512_loadu_ps(ag + g * D + 16 * c)));
        }
      }
    }
  }
}
#endif

}  // namespace
}  // namespace pagellm
