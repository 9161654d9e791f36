// The 8-bit KV cache formats of --kv-cache-dtype (cpu_kv_quant.cpp): fp8 encode/decode and the
// dequantization of one stored row, in registers (AVX-512) or plain loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

// The 8-bit cache's C entry points (cpu_kv_quant.cpp), declared once for the fused step
// (cpu_decoder.cpp) too.
extern "C" {
int pagellm_write_kv_quant(int fmt, int dtype, void* k_cache, void* v_cache, uint16_t* k_scales,
                           uint16_t* v_scales, const void* key, int64_t k_stride,
                           const void* value, int64_t v_stride, const int64_t* slots,
                           int64_t num_tokens, int64_t Hkv, int64_t D, int64_t num_slots,
                           float k_scale, float v_scale);
int pagellm_paged_attention_quant(int fmt, int dtype, void* out, int64_t out_stride,
                                  const void* q, int64_t q_stride, const void* k_cache,
                                  const void* v_cache, const uint16_t* k_scales,
                                  const uint16_t* v_scales, const int32_t* block_tables,
                                  int64_t bt_stride, int64_t num_seqs, const int64_t* q_rows,
                                  const int32_t* q_lens, const int32_t* seq_lens,
                                  const int64_t* bt_rows, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                  float scale, int64_t sliding_window, float soft_cap,
                                  float k_scale, float v_scale, const pagellm::CacheBounds* bounds);
}  // extern "C"

namespace pagellm {
namespace {

enum KVFormat : int { kE4M3 = 0, kE5M2 = 1, kInt8 = 2 };

// float -> fp8 (MB mantissa bits, exponent bias `bias`), round to nearest even, saturated at
// `maxv`; NaN becomes 0x7f (the formats' NaN, as torch).
inline uint8_t fp8_encode(float x, int MB, int bias, float maxv) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  float a = std::fabs(x);
  if (std::isnan(a)) return sign | 0x7f;
  a = std::min(a, maxv);
  const float min_normal = std::ldexp(1.f, 1 - bias);
  if (a < min_normal)  // subnormal: a multiple of 2^(1 - bias - MB); the code is the multiple
    return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, bias - 1 + MB)));
  uint32_t u;
  std::memcpy(&u, &a, 4);
  int e = static_cast<int>(u >> 23) - 127;
  const int shift = 23 - MB;
  uint32_t m = (u & 0x7fffffu) >> shift;
  const uint32_t rem = u & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (m & 1u))) ++m;
  if (m == (1u << MB)) {
    m = 0;
    ++e;
  }
  return sign | static_cast<uint8_t>(((e + bias) << MB) | m);
}

inline float fp8_decode(uint8_t b, int MB, int bias) {
  const int e = (b & 0x7f) >> MB, m = b & ((1 << MB) - 1);
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), 1 - bias - MB)
                           : std::ldexp(1.f + std::ldexp(static_cast<float>(m), -MB), e - bias);
  return (b & 0x80) ? -mag : mag;
}

inline uint8_t encode(int fmt, float x) {
  return fmt == kE4M3 ? fp8_encode(x, 3, 7, 448.f) : fp8_encode(x, 2, 15, 57344.f);
}

#if defined(__AVX512F__)
// 16 stored values as float32 "raw" values: int8 and e5m2 exact, e4m3 exact times 2^-8
// (raw_factor undoes it). fp8 goes through an IEEE half: e5m2 is a half's top byte; e4m3's
// sign-extended byte shifted left 7 holds its exponent and mantissa under a half's sign (bit
// 14, a copy of the sign, cleared), so half subnormals carry e4m3's subnormals exactly.
inline __m512 raw16(const uint8_t* src, int fmt) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if (fmt == kInt8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  if (fmt == kE5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  const __m256i w = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16(static_cast<short>(0xBF80))));
}

// cap * tanh(x / cap) for 16 scores, tanh(y) = 1 - 2 / (e^(2y) + 1) (exp16 clamps its input:
// +-1 far out, -cap for a masked -inf).
inline __m512 soft_cap16(__m512 x, float cap) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.f / cap)));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// raw16 of 32 stored values, with the format fixed at compile time: lo (values 0..15), hi.
template <int FMT>
inline void raw32(const uint8_t* src, __m512& lo, __m512& hi) {
  if constexpr (FMT == kInt8) {
    const __m128i* b = reinterpret_cast<const __m128i*>(src);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b + 1)));
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m512i h = FMT == kE5M2
        ? _mm512_slli_epi16(_mm512_cvtepu8_epi16(b), 8)
        : _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7),
                           _mm512_set1_epi16(static_cast<short>(0xBF80)));
    lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  }
}
#endif

// What raw16 values are multiplied by to give the stored value (before its scales).
inline float raw_factor(int fmt) { return fmt == kE4M3 ? 256.f : 1.f; }

// dst[0, D) = the D stored values of one row, dequantized (times `scale`).
inline void dequant_row(float* dst, const uint8_t* src, int64_t D, int fmt, float scale) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale * raw_factor(fmt));
  for (; d + 16 <= D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(raw16(src + d, fmt), s));
#endif
  for (; d < D; ++d)
    dst[d] = scale * (fmt == kInt8 ? static_cast<float>(static_cast<int8_t>(src[d]))
                      : fmt == kE4M3 ? fp8_decode(src[d], 3, 7) : fp8_decode(src[d], 2, 15));
}

// What one attention call fixes for all its items.
struct QuantPlan {
  int fmt;
  int64_t H, Hkv, G, D, block_size, window;
  float scale, soft_cap, k_scale, v_scale;
  const uint8_t *k_cache, *v_cache;
  const uint16_t *k_scales, *v_scales;  // bfloat16 bits, [slots, Hkv] (int8 only)

  // The stored row of kv head h of cache slot `slot`.
  const uint8_t* row(bool is_v, int64_t slot, int64_t h) const {
    return (is_v ? v_cache : k_cache) + (slot * Hkv + h) * D;
  }
  // Its dequantized values, into dst.
  void load(float* dst, bool is_v, int64_t slot, int64_t h) const {
    dequant_row(dst, row(is_v, slot, h), D, fmt, row_scale(is_v, slot, h));
  }
  // The scale its values are multiplied by: int8's per-(token, head) one, or fp8's per tensor.
  float row_scale(bool is_v, int64_t slot, int64_t h) const {
    if (fmt == kInt8) return bf16_to_f32((is_v ? v_scales : k_scales)[slot * Hkv + h]);
    return is_v ? v_scale : k_scale;
  }
  // The factor the raw (raw16) values of a row get beside its per-token scale: the per-tensor
  // fp8 scale and raw_factor (1 for int8, whose scale is per token).
  float tensor_factor(bool is_v) const {
    return fmt == kInt8 ? 1.f : (is_v ? v_scale : k_scale) * raw_factor(fmt);
  }
  // The slot of token t of a sequence with block-table row bt.
  int64_t slot(const int32_t* bt, int64_t t) const {
    return static_cast<int64_t>(bt[t / block_size]) * block_size + t % block_size;
  }
};

inline void axpy(float* y, float w, const float* x, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(y + d, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
#endif
  for (; d < D; ++d) y[d] += w * x[d];
}

constexpr int64_t kQuantPF = 2;  // blocks prefetched ahead (into L2, as bf16 decode does)

inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

// One decode row's keys: bt from the block of its first key (a window's; else block 0), L keys
// counted from that block's start, the first `skip` of them before the window.
struct QuantRow {
  const int32_t* bt;
  int64_t L, nblocks, skip;
};

}  // namespace
}  // namespace pagellm
