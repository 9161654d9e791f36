// Decode attention over an 8-bit KV cache with AVX-512 (cpu_kv_quant.cpp): one query row, every
// head, against its sequence's cached keys, in bf16 decode's passes (cpu_attention.cpp) with
// the 8-bit rows dequantized in registers (raw16), never into memory:
// - scores: block by block and kv head by kv head, each K row converted once (D / 16 vectors)
//   meets the G query heads of its group (the queries pre-scaled, fp8's per-tensor scale and
//   format factor folded in), unreduced, then a transpose-add tree (hsum16) gives 16 tokens'
//   scores a head; int8's per-token K scales multiply those 16 scores;
// - softmax: soft-cap, then exp(s - max) over the row's keys (a window's first keys exactly 0);
// - P.V: each V row converted once per block and chunk of dims, FMAs into the group's
//   accumulators held in registers, int8's per-token V scale folded into the weights;
// - store: normalized, times fp8's V scale, rounded once.
// Shapes with head_dim 64 or 128 and up to 8 query heads a kv head; others take the tile
// kernel or the plain loops. With bfloat16 queries the products are dot products instead of
// FMAs (cpu_kv_quant_dot.h): bfloat16 pairs for fp8 (AVX512-BF16), int16 pairs for int8
// (AVX512-VNNI).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"
#include "cpu_kv_quant.h"
#include "cpu_kv_quant_dot.h"

namespace pagellm {
namespace {

#if defined(__AVX512F__)

// scores[(kvh G + g) L + t] = q_g . raw k_t (times int8's K scale of token t) for t in [0, L);
// q [H][D] pre-scaled float32.
template <int FMT, int G, int NV>
void quant_scores(const QuantPlan& P, const QuantRow& r, const void* qv, const float*,
                  float* scores) {
  const float* q = static_cast<const float*>(qv);
  constexpr int64_t D = NV * 16;
  static_assert(NV % 2 == 0, "two accumulator chains a head");
  alignas(64) float lanes[G * 256];
  alignas(64) float ks[16];
  const int64_t bs = P.block_size, block_bytes = bs * P.Hkv * D;
  for (int64_t b = 0; b < r.nblocks; ++b) {
    const int64_t blk = r.bt[b], t0 = b * bs, n = std::min(bs, r.L - t0);
    if (b + kQuantPF < r.nblocks)
      prefetch_l2(P.k_cache + r.bt[b + kQuantPF] * block_bytes, block_bytes);
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
      const float* qg = q + kvh * G * D;
      for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t m = std::min<int64_t>(16, n - j0);
        const int64_t slot0 = blk * bs + j0;
        for (int64_t j = 0; j < m; ++j) {
          const uint8_t* kr = P.k_cache + ((slot0 + j) * P.Hkv + kvh) * D;
          __m512 k[NV];
          for (int c = 0; c < NV; c += 2) raw32<FMT>(kr + 16 * c, k[c], k[c + 1]);
          for (int g = 0; g < G; ++g) {
            const float* qh = qg + g * D;
            __m512 a0 = _mm512_mul_ps(k[0], _mm512_loadu_ps(qh));
            __m512 a1 = _mm512_mul_ps(k[1], _mm512_loadu_ps(qh + 16));
            for (int c = 2; c < NV; c += 2) {
              a0 = _mm512_fmadd_ps(k[c], _mm512_loadu_ps(qh + 16 * c), a0);
              a1 = _mm512_fmadd_ps(k[c + 1], _mm512_loadu_ps(qh + 16 * c + 16), a1);
            }
            _mm512_store_ps(lanes + (g * 16 + j) * 16, _mm512_add_ps(a0, a1));
          }
        }
        // Lanes of tokens past m hold stale sums: hsum16 keeps each token in its own lane and
        // the masked store drops them.
        const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1u);
        if constexpr (FMT == kInt8)
          for (int64_t j = 0; j < m; ++j)
            ks[j] = bf16_to_f32(P.k_scales[(slot0 + j) * P.Hkv + kvh]);
        for (int g = 0; g < G; ++g) {
          __m512 v = hsum16(reinterpret_cast<const __m512*>(lanes + g * 256));
          if constexpr (FMT == kInt8) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, ks));
          _mm512_mask_storeu_ps(scores + (kvh * G + g) * r.L + t0 + j0, mask, v);
        }
      }
    }
  }
}

// acc[(kvh G + g) D + d] += sum_t p[(kvh G + g) L + t] * v_t[d] (p already times int8's V
// scales): NC (even) vectors of dims at a time, G x NC accumulators in registers.
template <int FMT, int G, int NC>
void quant_pv(const QuantPlan& P, const QuantRow& r, const void* pv, int64_t ps, const float*,
              float* acc) {
  const float* p = static_cast<const float*>(pv);
  const int64_t D = P.D, bs = P.block_size, block_bytes = bs * P.Hkv * D;
  for (int64_t b = 0; b < std::min(kQuantPF, r.nblocks); ++b)
    prefetch_l2(P.v_cache + r.bt[b] * block_bytes, block_bytes);
  for (int64_t b = 0; b < r.nblocks; ++b) {
    const int64_t blk = r.bt[b], t0 = b * bs, n = std::min(bs, r.L - t0);
    const int64_t j_first = b == 0 ? r.skip : 0;  // keys before the window: not read
    if (b + kQuantPF < r.nblocks)
      prefetch_l2(P.v_cache + r.bt[b + kQuantPF] * block_bytes, block_bytes);
    for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
      const float* pg = p + kvh * G * ps + t0;
      for (int64_t d0 = 0; d0 < D; d0 += NC * 16) {
        __m512 a[G][NC];
        float* ag = acc + kvh * G * D + d0;
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(ag + g * D + 16 * c);
        for (int64_t j = j_first; j < n; ++j) {
          const uint8_t* vr = P.v_cache + ((blk * bs + j) * P.Hkv + kvh) * D + d0;
          __m512 v[NC];
          for (int c = 0; c < NC; c += 2) raw32<FMT>(vr + 16 * c, v[c], v[c + 1]);
          for (int g = 0; g < G; ++g) {
            const __m512 w = _mm512_set1_ps(pg[g * ps + j]);
            for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < NC; ++c) _mm512_storeu_ps(ag + g * D + 16 * c, a[g][c]);
      }
    }
  }
}

// The softmax weights of one head's scores s[0, L): soft-cap (0: none), then w[t] = exp(s[t] -
// max) (times vs[t], int8's V scale, where vs is not null) for t in [skip, L), w[0, skip) = 0,
// written as W (float32 w may be s itself; bfloat16 w padded with a 0 to an even length).
// Returns 1 / the sum of the exps.
template <typename W>
float quant_softmax_row(float* s, int64_t skip, int64_t L, float cap, const float* vs, W* w) {
  auto tail = [&](int64_t t) {
    return L - t >= 16 ? static_cast<__mmask16>(0xFFFF)
                       : static_cast<__mmask16>((1u << (L - t)) - 1u);
  };
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int64_t t = skip; t < L; t += 16) {
    const __mmask16 k = tail(t);
    __m512 x = _mm512_maskz_loadu_ps(k, s + t);
    if (cap > 0.f) {
      x = soft_cap16(x, cap);
      _mm512_mask_storeu_ps(s + t, k, x);
    }
    vm = _mm512_mask_max_ps(vm, k, vm, x);
  }
  const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = skip; t < L; t += 16) {
    const __mmask16 k = tail(t);
    const __m512 x0 = _mm512_maskz_loadu_ps(k, s + t);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(x0, mv)));
    sum = _mm512_add_ps(sum, e);
    const __m512 x = vs != nullptr ? _mm512_mul_ps(e, _mm512_maskz_loadu_ps(k, vs + t)) : e;
    if constexpr (sizeof(W) == 4) {
      _mm512_mask_storeu_ps(w + t, k, x);
    } else {
      alignas(64) uint16_t tmp[16];
      store16(tmp, x);
      std::memcpy(w + t, tmp, std::min<int64_t>(16, L - t) * 2);
    }
  }
  std::fill(w, w + skip, W{0});
  if constexpr (sizeof(W) == 2)
    if (L & 1) w[L] = 0;
  return 1.f / _mm512_reduce_add_ps(sum);
}

using QuantScoresFn = void (*)(const QuantPlan&, const QuantRow&, const void*, const float*,
                               float*);
using QuantPvFn = void (*)(const QuantPlan&, const QuantRow&, const void*, int64_t,
                           const float*, float*);

// The decode kernels picked for a call and what they take: float32 ones (the query pre-scaled,
// float32 weights), the bfloat16 dot-product ones (the query as is, bfloat16 weight pairs), or
// int8's integer ones (int16 query and weight pairs with per-head scales; V dims permuted).
enum QuantDecodeMode : int { kDecodeF32, kDecodeBf16, kDecodeInt16 };

struct QuantDecodeFns {
  QuantScoresFn scores = nullptr;
  QuantPvFn pv = nullptr;
  QuantDecodeMode mode = kDecodeF32;
};

// P.V's dims a pass: the most (of NV = D / 16 vectors, halving) that keep G x NC <= 24
// accumulators.
template <int G, int NV>
constexpr int pv_chunk_vectors() {
  int nc = NV;
  while (nc > 2 && G * nc > 24) nc /= 2;
  return nc;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#define PAGELLM_QDEC_BF16(g, nv)                                                     \
  if (bf16 && FMT == kInt8)                                                          \
    return {&quant_scores_i8<g, nv>, &quant_pv_i8<g, pv_chunk_vectors<g, nv>()>,     \
            kDecodeInt16};                                                           \
  if (bf16)                                                                          \
    return {&quant_scores_bf16<FMT, g, nv>,                                          \
            &quant_pv_bf16<FMT, g, pv_chunk_vectors<g, nv>()>, kDecodeBf16};
#elif defined(__AVX512BF16__)
#define PAGELLM_QDEC_BF16(g, nv)                                                     \
  if (bf16)                                                                          \
    return {&quant_scores_bf16<FMT, g, nv>,                                          \
            &quant_pv_bf16<FMT, g, pv_chunk_vectors<g, nv>()>, kDecodeBf16};
#else
#define PAGELLM_QDEC_BF16(g, nv)
#endif

// The register-blocked decode kernels for (format, G, D), or nulls where none is compiled;
// bf16: the query is bfloat16 (the dot-product kernels where the build has them).
template <int FMT>
QuantDecodeFns pick_quant_decode_for(int64_t G, int64_t D, bool bf16) {
  (void)bf16;
#define PAGELLM_QDEC_CASE(g)                                                                    \
  case g:                                                                                       \
    if (D == 64) {                                                                              \
      PAGELLM_QDEC_BF16(g, 4)                                                                   \
      return {&quant_scores<FMT, g, 4>, &quant_pv<FMT, g, pv_chunk_vectors<g, 4>()>, kDecodeF32}; \
    }                                                                                           \
    if (D == 128) {                                                                             \
      PAGELLM_QDEC_BF16(g, 8)                                                                   \
      return {&quant_scores<FMT, g, 8>, &quant_pv<FMT, g, pv_chunk_vectors<g, 8>()>, kDecodeF32}; \
    }                                                                                           \
    break;
  switch (G) {
    PAGELLM_QDEC_CASE(1)
    PAGELLM_QDEC_CASE(2)
    PAGELLM_QDEC_CASE(3)
    PAGELLM_QDEC_CASE(4)
    PAGELLM_QDEC_CASE(5)
    PAGELLM_QDEC_CASE(6)
    PAGELLM_QDEC_CASE(7)
    PAGELLM_QDEC_CASE(8)
    default:
      break;
  }
#undef PAGELLM_QDEC_CASE
  return {};
}
#undef PAGELLM_QDEC_BF16

inline QuantDecodeFns pick_quant_decode(int fmt, int64_t G, int64_t D, bool bf16) {
  if (fmt == kE4M3) return pick_quant_decode_for<kE4M3>(G, D, bf16);
  if (fmt == kE5M2) return pick_quant_decode_for<kE5M2>(G, D, bf16);
  return pick_quant_decode_for<kInt8>(G, D, bf16);
}

// One thread's buffers: the query (pre-scaled float32, or int16), scores [H][L], accumulators
// [H][D], 1 / sums [H], int8's V scales of a kv head [L], weights as pairs [H][L rounded up to
// even] (bfloat16 or int16), int16 query and weight scales [H].
struct QuantDecodeScratch {
  std::vector<float> q, scores, acc, inv, vs, qs, ws;
  std::vector<uint16_t> pb;
  std::vector<int16_t> qi;
};

// Query row q (H x D) at position L - 1 of its sequence (block-table row bt), into out.
template <typename C>
void quant_decode_row(const QuantPlan& P, const QuantDecodeFns& fns, const typename C::T* q,
                      typename C::T* out, const int32_t* bt, int64_t L, QuantDecodeScratch& s) {
  const int64_t H = P.H, D = P.D;
  const int64_t start = P.window > 0 && L > P.window ? L - P.window : 0;
  const int64_t first = start / P.block_size, Lw = L - first * P.block_size;
  const QuantRow r{bt + first, Lw, (Lw + P.block_size - 1) / P.block_size,
                   start - first * P.block_size};
  s.scores.resize(H * Lw);
  s.acc.assign(H * D, 0.f);
  const float qf = P.scale * P.tensor_factor(false);
  if (fns.mode == kDecodeBf16) {
    fns.scores(P, r, q, nullptr, s.scores.data());
  } else if (fns.mode == kDecodeInt16) {  // per head: q = qi * qs, qi in [-32767, 32767]
    s.qi.resize(H * D);
    s.qs.resize(H);
    for (int64_t h = 0; h < H; ++h) {
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(C::load(q[h * D + d])));
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int64_t d = 0; d < D; ++d)
        s.qi[h * D + d] = static_cast<int16_t>(std::nearbyint(C::load(q[h * D + d]) * inv));
      s.qs[h] = amax / 32767.f * qf;
    }
    fns.scores(P, r, s.qi.data(), s.qs.data(), s.scores.data());
  } else {
    s.q.resize(H * D);
    for (int64_t i = 0; i < H * D; ++i) s.q[i] = C::load(q[i]) * qf;
    fns.scores(P, r, s.q.data(), nullptr, s.scores.data());
  }
  s.inv.resize(H);
  float* inv = s.inv.data();
  const int64_t Lp = Lw + (Lw & 1);  // the weight pairs' row length
  if (fns.mode == kDecodeBf16) s.pb.resize(H * Lp);
  s.vs.resize(Lw);
  float vs_max = 0.f;
  for (int64_t kvh = 0; kvh < P.Hkv; ++kvh) {
    if (P.fmt == kInt8) {  // int8's V scales of this kv head, into the weights
      vs_max = 0.f;
      for (int64_t b = 0, t = 0; b < r.nblocks; ++b) {
        const uint16_t* vs = P.v_scales + r.bt[b] * P.block_size * P.Hkv + kvh;
        for (int64_t j = 0; j < P.block_size && t < Lw; ++j, ++t) {
          s.vs[t] = bf16_to_f32(vs[j * P.Hkv]);
          if (t >= r.skip) vs_max = std::max(vs_max, s.vs[t]);
        }
      }
    }
    const float* vs = P.fmt == kInt8 ? s.vs.data() : nullptr;
    for (int64_t h = kvh * P.G; h < (kvh + 1) * P.G; ++h) {
      float* sc = s.scores.data() + h * Lw;
      inv[h] = fns.mode == kDecodeBf16
                   ? quant_softmax_row(sc, r.skip, Lw, P.soft_cap, vs, s.pb.data() + h * Lp)
                   : quant_softmax_row(sc, r.skip, Lw, P.soft_cap, vs, sc);
    }
    if (fns.mode == kDecodeInt16) {  // weights (each <= vs_max) as int16 of scale vs_max/32767
      s.qi.resize(H * Lp);
      s.ws.resize(H);
      const float f = vs_max > 0.f ? 32767.f / vs_max : 0.f;
      for (int64_t h = kvh * P.G; h < (kvh + 1) * P.G; ++h) {
        const float* w = s.scores.data() + h * Lw;
        int16_t* dst = s.qi.data() + h * Lp;
        int64_t t = 0;
        const __m512 vf = _mm512_set1_ps(f);
        for (; t + 16 <= Lw; t += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t),
                              _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                  _mm512_mul_ps(_mm512_loadu_ps(w + t), vf))));
        for (; t < Lw; ++t) dst[t] = static_cast<int16_t>(std::nearbyint(w[t] * f));
        if (Lw & 1) dst[Lw] = 0;
        s.ws[h] = vs_max / 32767.f;
      }
    }
  }
  if (fns.mode == kDecodeBf16)
    fns.pv(P, r, s.pb.data(), Lp, nullptr, s.acc.data());
  else if (fns.mode == kDecodeInt16)
    fns.pv(P, r, s.qi.data(), Lp, s.ws.data(), s.acc.data());
  else
    fns.pv(P, r, s.scores.data(), Lw, nullptr, s.acc.data());
  const float vf = P.tensor_factor(true);
  for (int64_t h = 0; h < H; ++h) {
    const float f = inv[h] * vf;
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
    if (fns.mode == kDecodeInt16) {
      for (int64_t k = 0; k < D; ++k)
        out[h * D + quant_pair_dim(k)] = C::store(s.acc[h * D + k] * f);
      continue;
    }
#endif
    for (int64_t d = 0; d < D; d += 16)
      store16(out + h * D + d, _mm512_mul_ps(_mm512_loadu_ps(s.acc.data() + h * D + d),
                                             _mm512_set1_ps(f)));
  }
}
#endif  // __AVX512F__

}  // namespace
}  // namespace pagellm
