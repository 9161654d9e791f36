// Prefill chunks over an 8-bit KV cache with AVX-512 (cpu_kv_quant.cpp), flash style per
// (sequence, kv head, tile of query rows), the bf16 vector prefill kernel's micro-kernel
// (cpu_prefill_vec.cpp) on K/V dequantized once per tile:
// - per step of 64 keys the tile's K/V rows are converted (raw16: exact integers or fp8 values)
//   into a thread-local buffer of one step, packed as that kernel packs a unit: K with the dims
//   outermost (bfloat16 dim pairs x 16 keys, or float32 dims x 16 keys), V with the dims in the
//   lanes (bfloat16 key pairs, or float32 rows); never more of the cache than that step;
// - every (query head of the group, 4 rows) pass over the step: 16 score vectors (broadcast
//   query elements against 16 keys a vector), times each key's factor (the softmax scale, fp8's
//   per-tensor K scale, int8's per-token K scale), soft-cap, causal/window masks, an online
//   softmax in base 2 (float32, state kept per row across steps), P (times int8's per-token V
//   scales; rounded to bfloat16 for the bfloat16 dot products) against V into float32 rows;
// - store: normalized, times fp8's V scale, rounded once.
// T = uint16_t (bfloat16 queries, AVX512-BF16, head_dim % 32 == 0) or float (any query dtype,
// head_dim % 16 == 0), head_dim <= 256.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_kv_quant.h"

namespace pagellm {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kQuantStep = 64;  // keys a step (4 vectors of scores a row)
constexpr int kQuantRows = 4;       // query rows a pass
constexpr int64_t kQuantMaxD = 256;

// The element type's operands and packed layouts (as cpu_prefill_vec.cpp's Vec).
template <typename T>
struct QuantVec;

template <>
struct QuantVec<float> : VecOps<float> {
  static inline void store_p(float* dst, __m512 p) { _mm512_store_ps(dst, p); }
  static inline void put16(float* dst, __m512 x) { _mm512_storeu_ps(dst, x); }
  static inline const float* v_at(const float* vt, int64_t D, int64_t w, int64_t dd) {
    return vt + w * D + dd * 16;  // V as rows [keys][D]
  }
};

#if defined(__AVX512BF16__)
template <>
struct QuantVec<uint16_t> : VecOps<uint16_t> {
  static inline void store_p(uint16_t* dst, __m512 p) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst), to_bf16x16(p));
  }
  static inline void put16(uint16_t* dst, __m512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), to_bf16x16(x));
  }
  // V per 32 keys as [D/16][16 key pairs][16 dims][2] (cpu_prefill.h's pack_v_bf16).
  static inline const uint16_t* v_at(const uint16_t* vt, int64_t D, int64_t w, int64_t dd) {
    return vt + 32 * (w >> 4) * D + dd * 512 + (w & 15) * 32;
  }
};
#endif

// One thread's buffers: the tile's queries [G][rows][D] (in T) and float32 output rows, the
// running maxima and sums per row, one step's packed K/V and raw rows, per-key factors.
template <typename T>
struct QuantTileScratch {
  std::vector<T> q, kt, vt, rows;
  std::vector<float> o, m, l;
  alignas(64) float kf[kQuantStep], vf[kQuantStep];
};

// Raw values (raw16) of keys [k0, k0 + nk) of kv head h, K or V, as rows [kQuantStep][D] of
// T, zeros past nk; f[j] = the per-key factor (int8's scale, else 1; 0 past nk) times `mul`.
template <int FMT, typename T>
void quant_rows(const QuantPlan& P, bool is_v, const int32_t* bt, int64_t k0, int64_t nk,
                int64_t h, T* rows, float* f, float mul) {
  const uint16_t* scales = is_v ? P.v_scales : P.k_scales;
  const int64_t D = P.D, bs = P.block_size;
  int64_t blk = k0 / bs, off = k0 % bs;  // key k0 + j's block and offset in it
  for (int64_t j = 0; j < nk; ++j) {
    const int64_t slot = bt[blk] * bs + off;
    if (++off == bs) {
      off = 0;
      ++blk;
    }
    T* dst = rows + j * D;
    const uint8_t* src = P.row(is_v, slot, h);
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
      __m512 lo, hi;
      raw32<FMT>(src + d, lo, hi);
      QuantVec<T>::put16(dst + d, lo);
      QuantVec<T>::put16(dst + d + 16, hi);
    }
    if (d < D) QuantVec<T>::put16(dst + d, raw16(src + d, FMT));  // D % 32 == 16
    if constexpr (FMT == kInt8)
      f[j] = mul * bf16_to_f32(scales[slot * P.Hkv + h]);
    else
      f[j] = mul;
  }
  if (nk < kQuantStep) {
    std::memset(rows + nk * D, 0, (kQuantStep - nk) * D * sizeof(T));
    std::fill(f + nk, f + kQuantStep, 0.f);
  }
}

// One step's K/V of kv head h packed into s.kt / s.vt (and s.kf / s.vf).
// (Not inlined: once a step, and inlined thrice it keeps the compiler from inlining the passes.)
template <int FMT, typename T>
__attribute__((noinline)) void quant_pack_step(const QuantPlan& P, const int32_t* bt, int64_t k0,
                                               int64_t nk, int64_t h, QuantTileScratch<T>& s) {
  const int64_t D = P.D;
  constexpr int64_t W = 64 / sizeof(T);  // elements per 64 bytes
  T* rows = s.rows.data();
  quant_rows<FMT>(P, false, bt, k0, nk, h, rows, s.kf, P.scale * P.tensor_factor(false));
  __m512i r[16];
  for (int64_t jg = 0; jg < kQuantStep / 16; ++jg)
    for (int64_t c = 0; c < D / W; ++c) {
      for (int64_t n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(rows + (jg * 16 + n) * D + c * W);
      transpose16(r);
      for (int i = 0; i < 16; ++i)
        _mm512_storeu_si512(s.kt.data() + jg * 16 * D + (c * 16 + i) * W, r[i]);
    }
  if constexpr (sizeof(T) == 4) {
    quant_rows<FMT>(P, true, bt, k0, nk, h, s.vt.data(), s.vf, 1.f);
  } else {
    quant_rows<FMT>(P, true, bt, k0, nk, h, rows, s.vf, 1.f);
    for (int64_t k = 0; k < kQuantStep; k += 32)  // pack_v_bf16's interleave, from the rows
      for (int64_t p = 0; p < 16; ++p) {
        const T* r0 = rows + (k + 2 * p) * D;
        const T* r1 = r0 + D;
        for (int64_t dd = 0; dd < D / 16; ++dd) {
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + dd * 16));
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + dd * 16));
          const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                                               _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
          _mm512_storeu_si512(s.vt.data() + k * D + dd * 512 + p * 32, pair);
        }
      }
  }
}

// o[i][16 (dd0 + c) ...] = o * alpha[i] + P[i] . V for NC dim blocks from dd0.
template <typename T, int NC>
inline void quant_pv_chunk(float* o, int64_t D, const T* vt, const T* pbuf, const float* alpha,
                           int64_t dd0) {
  using V = QuantVec<T>;
  __m512 acc[kQuantRows][NC];
  for (int i = 0; i < kQuantRows; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < NC; ++c)
      acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + (dd0 + c) * 16), al);
  }
  for (int64_t w = 0; w < kQuantStep / V::kPer; ++w) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = V::load(V::v_at(vt, D, w, dd0 + c));
    for (int i = 0; i < kQuantRows; ++i) {
      const __m512 b = V::bcast(pbuf + i * kQuantStep + w * V::kPer);
      for (int c = 0; c < NC; ++c) acc[i][c] = V::madd(acc[i][c], vv[c], b);
    }
  }
  for (int i = 0; i < kQuantRows; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + i * D + (dd0 + c) * 16, acc[i][c]);
}

// Lanes [a, b) of 16 set (clamped to [0, 16)).
inline __mmask16 lane_range(int64_t a, int64_t b) {
  a = std::clamp<int64_t>(a, 0, 16);
  b = std::clamp<int64_t>(b, 0, 16);
  if (b <= a) return 0;
  return static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
}

// One pass: 4 query rows (qi, positions pos) of one head over the packed step at k0 (nk keys),
// their running maxima m, sums l (16 lanes a row) and float32 rows o updated.
// (Always inlined: GCC kept it out of line once the packing had three instances, 15% slower.)
template <typename T>
__attribute__((always_inline)) inline void quant_pass(
    const QuantPlan& P, const QuantTileScratch<T>& s, const T* const* qi, const int64_t* pos,
    int64_t k0, int64_t nk, float* m, float* l, float* o) {
  using V = QuantVec<T>;
  const int64_t D = P.D, W = P.window;
  // Scores in base 2: per-key factors (int8's scales; any, with a soft-cap) multiply them, a
  // factor common to every key (fp8) is folded into c.
  const bool per_key = P.fmt == kInt8 || P.soft_cap > 0.f;
  const float c = 1.44269504088896341f * (per_key ? 1.f : s.kf[0]);
  const __m512 vc = _mm512_set1_ps(c);
  __m512 sc[kQuantRows][4];
  for (int i = 0; i < kQuantRows; ++i)
    for (int j = 0; j < 4; ++j) sc[i][j] = _mm512_setzero_ps();
  const T* kt = s.kt.data();
  for (int64_t u = 0; u < D / V::kPer; ++u) {
    __m512 b[kQuantRows];
    for (int i = 0; i < kQuantRows; ++i) b[i] = V::bcast(qi[i] + u * V::kPer);
    for (int j = 0; j < 4; ++j) {
      const __m512 kj = V::load(kt + j * 16 * D + u * 16 * V::kPer);
      for (int i = 0; i < kQuantRows; ++i) sc[i][j] = V::madd(sc[i][j], kj, b[i]);
    }
  }
  // Every key visible to every row: no masks.
  const bool full = nk == kQuantStep && k0 + kQuantStep - 1 <= pos[0] &&
                    (W == 0 || k0 > pos[kQuantRows - 1] - W);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __mmask16 mk[kQuantRows][4];
  alignas(64) float mx[16] = {}, mo[16] = {}, alpha[16];
  for (int i = 0; i < kQuantRows; ++i) {
    const int64_t a = W > 0 ? pos[i] - W + 1 - k0 : 0, b = std::min(nk, pos[i] - k0 + 1);
    __m512 v = neg_inf;
    for (int j = 0; j < 4; ++j) {
      if (per_key) sc[i][j] = _mm512_mul_ps(sc[i][j], _mm512_load_ps(s.kf + 16 * j));
      if (P.soft_cap > 0.f) sc[i][j] = soft_cap16(sc[i][j], P.soft_cap);
      if (!full) {
        mk[i][j] = lane_range(a - 16 * j, b - 16 * j);
        sc[i][j] = _mm512_mask_mov_ps(neg_inf, mk[i][j], sc[i][j]);
      }
      v = _mm512_max_ps(v, sc[i][j]);
    }
    mo[i] = m[i];
    mx[i] = std::max(m[i], _mm512_reduce_max_ps(v));
  }
  // alpha = 2^((m_old - m_new) c): exp2_16 turns -inf - -inf (a row that has seen no key yet;
  // its o and l are 0) and -inf into 2^-125.
  _mm512_store_ps(alpha, exp2_16(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(mo),
                                                              _mm512_load_ps(mx)), vc)));
  alignas(64) T pbuf[kQuantRows * kQuantStep];
  for (int i = 0; i < kQuantRows; ++i) {
    const __m512 rm = _mm512_set1_ps(mx[i] * c);
    __m512 psum = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      __m512 p = exp2_16(_mm512_fmsub_ps(sc[i][j], vc, rm));
      if (!full) p = _mm512_maskz_mov_ps(mk[i][j], p);
      psum = _mm512_add_ps(psum, p);
      if (P.fmt == kInt8) p = _mm512_mul_ps(p, _mm512_load_ps(s.vf + 16 * j));
      V::store_p(pbuf + i * kQuantStep + j * 16, p);
    }
    // l: the row's 16 lane sums (reduced once, at the end).
    _mm512_storeu_ps(l + 16 * i, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * i),
                                                 _mm512_set1_ps(alpha[i]), psum));
    m[i] = mx[i];
  }
  const T* vt = s.vt.data();
  for (int64_t dd = 0, DB = D / 16; dd < DB;) {
    if (DB - dd >= 4) {
      quant_pv_chunk<T, 4>(o, D, vt, pbuf, alpha, dd);
      dd += 4;
    } else if (DB - dd >= 2) {
      quant_pv_chunk<T, 2>(o, D, vt, pbuf, alpha, dd);
      dd += 2;
    } else {
      quant_pv_chunk<T, 1>(o, D, vt, pbuf, alpha, dd);
      dd += 1;
    }
  }
}

// Rows [r0, r0 + R) of a chunk of q_len new rows whose sequence now holds n tokens, every
// query head of kv head h's group: steps of 64 keys from the first key the tile sees, each
// dequantized once for all its G x R queries.
template <typename C, typename T>
void quant_attend_tile(const QuantPlan& P, const typename C::T* q, int64_t q_stride,
                       typename C::T* out, int64_t out_stride, const int32_t* bt, int64_t n,
                       int64_t q_len, int64_t r0, int64_t R, int64_t h, QuantTileScratch<T>& s) {
  const int64_t D = P.D, G = P.G, Rp = (R + kQuantRows - 1) / kQuantRows * kQuantRows;
  const int64_t first = n - q_len + r0;  // row r0's position
  s.q.resize(G * Rp * D);
  s.o.assign(G * Rp * D, 0.f);
  s.m.assign(G * Rp, -INFINITY);
  s.l.assign(G * Rp * 16, 0.f);
  s.kt.resize(kQuantStep * D);
  s.vt.resize(kQuantStep * D);
  s.rows.resize(kQuantStep * D);
  for (int64_t g = 0; g < G; ++g)  // rows past R repeat the last one (computed, not stored)
    for (int64_t i = 0; i < Rp; ++i) {
      const typename C::T* src = q + (r0 + std::min(i, R - 1)) * q_stride + (h * G + g) * D;
      T* dst = s.q.data() + (g * Rp + i) * D;
      if constexpr (std::is_same_v<typename C::T, T>)
        std::memcpy(dst, src, D * sizeof(T));
      else
        for (int64_t d = 0; d < D; ++d) dst[d] = C::load(src[d]);
    }
  const int64_t lo = P.window > 0 ? std::max<int64_t>(0, first - P.window + 1) : 0;
  const int64_t hi = first + R;  // keys [lo, hi): the last row sees up to its own position
  for (int64_t k0 = lo; k0 < hi; k0 += kQuantStep) {
    const int64_t nk = std::min(kQuantStep, hi - k0);
    if (P.fmt == kE4M3)
      quant_pack_step<kE4M3>(P, bt, k0, nk, h, s);
    else if (P.fmt == kE5M2)
      quant_pack_step<kE5M2>(P, bt, k0, nk, h, s);
    else
      quant_pack_step<kInt8>(P, bt, k0, nk, h, s);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t rr = 0; rr < Rp; rr += kQuantRows) {
        const T* qi[kQuantRows];
        int64_t pos[kQuantRows];
        for (int i = 0; i < kQuantRows; ++i) {
          qi[i] = s.q.data() + (g * Rp + rr + i) * D;
          pos[i] = first + std::min<int64_t>(rr + i, R - 1);
        }
        // No row of the pass sees a key of the step.
        if (k0 > pos[kQuantRows - 1] || (P.window > 0 && k0 + nk - 1 <= pos[0] - P.window))
          continue;
        const int64_t at = g * Rp + rr;
        quant_pass(P, s, qi, pos, k0, nk, s.m.data() + at, s.l.data() + at * 16,
                   s.o.data() + at * D);
      }
  }
  const float vf = P.tensor_factor(true);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < R; ++i) {
      const float* o = s.o.data() + (g * Rp + i) * D;
      const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(s.l.data() + (g * Rp + i) * 16));
      const __m512 f = _mm512_set1_ps(vf / sum);
      typename C::T* dst = out + (r0 + i) * out_stride + (h * G + g) * D;
      for (int64_t d = 0; d < D; d += 16)
        store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), f));
    }
}
#endif  // __AVX512F__

}  // namespace
}  // namespace pagellm
