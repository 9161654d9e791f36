// The 8-bit KV cache formats of --kv-cache-dtype (cpu_kv_quant.cpp): fp8 encode/decode and the
// dequantization of one stored row, in registers (AVX-512) or plain loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

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

// dst[0, D) = the D stored values of one row, dequantized (times `scale`).
inline void dequant_row(float* dst, const uint8_t* src, int64_t D, int fmt, float scale) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(fmt == kE4M3 ? scale * 256.f : scale);
  for (; d + 16 <= D; d += 16) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
    __m512 x;
    if (fmt == kInt8) {
      x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    } else {
      // fp8 as the top bits of an IEEE half: e5m2 is a half's top byte; e4m3's exponent and
      // mantissa shifted under a half's sign come out 2^-8 too small (256 is in the scale).
      const __m256i w = _mm256_cvtepu8_epi16(bytes);
      const __m256i h = fmt == kE5M2
          ? _mm256_slli_epi16(w, 8)
          : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                            _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7f)), 7));
      x = _mm512_cvtph_ps(h);
    }
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(x, s));
  }
#endif
  for (; d < D; ++d)
    dst[d] = scale * (fmt == kInt8 ? static_cast<float>(static_cast<int8_t>(src[d]))
                      : fmt == kE4M3 ? fp8_decode(src[d], 3, 7) : fp8_decode(src[d], 2, 15));
}

inline void axpy(float* y, float w, const float* x, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(y + d, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + d), _mm512_loadu_ps(y + d)));
#endif
  for (; d < D; ++d) y[d] += w * x[d];
}

}  // namespace
}  // namespace pagellm
