// The vector building blocks of decode attention (cpu_attention.cpp): scores of a query row
// against a block's K rows, the softmax numerators, and P.V accumulated into registers. AVX-512
// (with AVX512-BF16 for the bfloat16 dot products) where the build has it, plain loops else.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_common.h"

namespace pagellm {
namespace {

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
}  // namespace
}  // namespace pagellm
