// The weight formats of the fused MoE kernel (cpu_moe.cpp): how its packed stacks store a step
// of k, and the quantization data (int8 row scales, int4 group scales) read beside them.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_common.h"

namespace pagellm {
namespace {

struct Int4 {};  // the int4 weight format (Fmt<T, Int4>)

// The quantization data of one call (null where the format has none), bfloat16 as the quantized
// methods keep it: int8 per-output scales rs13 [E, 2I] (gate rows, then up rows) and rs2 [E, H];
// int4 (scale, zero) pairs per group and output, sz13 [E, H/group, 2I, 2] and sz2
// [E, I/group, H, 2], the weight being (code - 8) * scale + zero (torch's int4 CPU op's).
struct QuantData {
  const uint16_t *rs13 = nullptr, *rs2 = nullptr, *sz13 = nullptr, *sz2 = nullptr;
  int64_t group = 0;
};

#if defined(__AVX512F__)
// Weight formats: how one step (kDims input dims) of a block of 16 outputs is stored (kStep
// values of Store) and becomes kVecs madd operands of the activations' dtype T.
// - plain T: the operand itself (16 float32, or 16 bfloat16 pairs);
// - int8 codes in the same element order: converted exactly (|q| <= 127 fits bfloat16's 8 bits),
//   the per-output scales applied to the sums (kRowScales);
// - int4 codes (Int4), two dims per step, byte n = code(n, k) | code(n, k + 1) << 4: dequantized
//   in registers as code * scale + min of the step's group (kGrouped; see ExpertQuant), then
//   rounded to T (float32: two operands, for dims k and k + 1).
template <typename T, typename W>
struct Fmt {  // plain
  using Store = T;
  static constexpr int64_t kDims = VecOps<T>::kPer;
  static constexpr int64_t kStep = 16 * kDims;
  static constexpr int kVecs = 1;
  static constexpr int kMaxRows = 6;
  static constexpr bool kRowScales = false, kGrouped = false;
  static inline void load(const Store* p, __m512* v, __m512, __m512) { v[0] = VecOps<T>::load(p); }
};

template <typename T>
struct Fmt<T, int8_t> {
  using Store = int8_t;
  static constexpr int64_t kDims = VecOps<T>::kPer;
  static constexpr int64_t kStep = 16 * kDims;
  static constexpr int kVecs = 1;
  static constexpr int kMaxRows = 6;
  static constexpr bool kRowScales = true, kGrouped = false;
  static inline __m512 cvt16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  static inline void load(const Store* p, __m512* v, __m512, __m512) {
    if constexpr (std::is_same<T, float>::value) {
      v[0] = cvt16(p);
    } else {
#if defined(__AVX512BF16__)
      v[0] = (__m512)_mm512_cvtne2ps_pbh(cvt16(p + 16), cvt16(p));
#endif
    }
  }
};

template <typename T>
struct Fmt<T, Int4> {
  using Store = uint8_t;
  static constexpr int64_t kDims = 2;
  static constexpr int64_t kStep = 16;
  static constexpr int kVecs = std::is_same<T, float>::value ? 2 : 1;
  static constexpr int kMaxRows = 3;  // room for the group's scales and mins in registers
  static constexpr bool kRowScales = false, kGrouped = true;
  static inline void load(const Store* p, __m512* v, __m512 scale, __m512 min) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    const __m512 lo = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), scale, min);
    const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), scale, min);
    if constexpr (std::is_same<T, float>::value) {
      v[0] = lo;
      v[1] = hi;
    } else {
#if defined(__AVX512BF16__)
      // [lo 0..15 | hi 0..15] as bfloat16 -> pairs (lo n, hi n) in lane n.
      const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
      v[0] = _mm512_castsi512_ps(
          _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
#endif
    }
  }
};

// One expert's quantization data for one of its stacks of N outputs: row scales [N], or
// (scale, zero) pairs [K/group][N][2].
struct ExpertQuant {
  const uint16_t *rows = nullptr, *sz = nullptr;
  int64_t n = 0, group = 0;

  // The scales and mins (zero - 8 scale, as torch's op computes it in float32) of the 16 outputs
  // from `out0` in the group of input dim k.
  inline void group_of(int64_t k, int64_t out0, __m512& scale, __m512& min) const {
    const __m512i v = _mm512_loadu_si512(sz + ((k / group) * n + out0) * 2);
    scale = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
    min = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
  }
};

#endif  // __AVX512F__

}  // namespace
}  // namespace pagellm
