// Shared by the CPU kernels: bfloat16 conversions and the per-dtype load/store/round helpers.
// bfloat16 travels as uint16_t bits; arithmetic is float32.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagellm {

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// The cache writers' loop: row(t) for every token t whose slot lies in [0, num_slots), in
// parallel for many tokens; returns false where some slot lay outside (those tokens skipped,
// nothing written for them).
template <typename Fn>
inline bool for_each_slot(const int64_t* slots, int64_t num_tokens, int64_t num_slots, Fn&& row) {
  int out_of_bounds = 0;
#pragma omp parallel for if (num_tokens > 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0 || slots[t] >= num_slots) {
#pragma omp atomic write
      out_of_bounds = 1;
      continue;
    }
    row(t);
  }
  return out_of_bounds == 0;
}

// Whether an attention call's shape is one the kernels index safely: positive sizes, the query
// heads whole groups of the kv heads. Every attention entry point checks it before it divides
// by any of them.
inline bool attention_shape_ok(int64_t H, int64_t Hkv, int64_t D, int64_t block_size) {
  return H > 0 && Hkv > 0 && H % Hkv == 0 && D > 0 && block_size > 0;
}

// What an attention call may index, checked once per sequence before it reads the cache: block
// ids in [0, num_blocks), block-table rows in [0, bt_rows) of bt_width entries each, query and
// output rows in [0, rows). A call that finds anything outside answers kOutOfBounds.
struct CacheBounds {
  int64_t num_blocks, bt_rows, bt_width, rows;

  // A sequence of len cached tokens on block-table row bt_row: the row exists, len fits in it,
  // every block id it reads exists.
  bool sequence_ok(const int32_t* block_tables, int64_t bt_stride, int64_t bt_row, int64_t len,
                   int64_t block_size) const {
    if (bt_row < 0 || bt_row >= bt_rows || len < 1 || len > bt_width * block_size) return false;
    const int32_t* bt = block_tables + bt_row * bt_stride;
    for (int64_t b = 0, n = (len + block_size - 1) / block_size; b < n; ++b)
      if (bt[b] < 0 || bt[b] >= num_blocks) return false;
    return true;
  }
  // Rows [r0, r0 + n) of the query and output.
  bool rows_ok(int64_t r0, int64_t n) const { return r0 >= 0 && n >= 0 && r0 + n <= rows; }
};

// The entry points' answers: 1 done, 0 refused (a shape or dtype this build cannot take; nothing
// done), kOutOfBounds (an index outside the cache or the batch; nothing read outside them, the
// output incomplete).
constexpr int kOutOfBounds = -1;

struct F32 {
  using T = float;
  static inline float load(float x) { return x; }
  static inline float store(float x) { return x; }
  static inline float round(float x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  static inline float load(uint16_t x) { return bf16_to_f32(x); }
  static inline uint16_t store(float x) { return f32_to_bf16(x); }
  static inline float round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
};

#if defined(__AVX512F__)
// exp of 16 floats: Cephes' expf polynomial after range reduction, ~1 ulp; inputs are clamped
// to [-87, 88] (results stay finite and normal).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// 2^x of 16 floats for softmax weights: a degree-4 polynomial on [-0.5, 0.5] after range
// reduction, relative error ~3e-6 (far below the bfloat16 rounding the weights get). Inputs
// are clamped to [-125, 127]: -inf gives 2^-125, a normal float (denormals are slow), never
// 0 or NaN.
inline __m512 exp2_16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-125.0f)), _mm512_set1_ps(127.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(9.57008e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.591786e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4024746e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931218e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.999993e-1f));
  return _mm512_scalef_ps(y, n);
}

// float32 -> bfloat16 (round to nearest even), 16 at a time; NaN stays NaN.
inline __m256i to_bf16x16(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

// Transposes 16 x 16 32-bit elements held as 16 rows in place: rows of 16 bf16 pairs become
// the VNNI layout of a B tile (pair r of every row in tile row r), and back for float32 tiles.
inline void transpose16(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i u0 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0x88);
    const __m512i u1 = _mm512_shuffle_i32x4(b[q], b[4 + q], 0xDD);
    const __m512i v0 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(b[8 + q], b[12 + q], 0xDD);
    r[q] = _mm512_shuffle_i32x4(u0, v0, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(u1, v1, 0x88);
    r[8 + q] = _mm512_shuffle_i32x4(u0, v0, 0xDD);
    r[12 + q] = _mm512_shuffle_i32x4(u1, v1, 0xDD);
  }
}

// r[j] = sum of the lanes of v[j], for 16 vectors (a transpose-and-add tree).
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // x[k], 128-bit lane L, slot m: the lane-L partial sum of v[4k + m].
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                  _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                  _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// The AVX-512 kernels' dot-product operands: a vector of 16 float32, or of 16 bfloat16 pairs
// (AVX512-BF16); madd adds the products of a and b (pair by pair) to float32 lanes. kPer is the
// elements one lane holds, bcast puts one lane's worth of p in every lane.
template <typename T>
struct VecOps;

template <>
struct VecOps<float> {
  static constexpr int64_t kPer = 1;
  static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static inline __m512 bcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline __m512 madd(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
};

#if defined(__AVX512BF16__)
template <>
struct VecOps<uint16_t> {
  static constexpr int64_t kPer = 2;
  static inline __m512 load(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_loadu_si512(p));
  }
  static inline __m512 bcast(const uint16_t* p) {
    int32_t pair;
    std::memcpy(&pair, p, 4);
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  static inline __m512 madd(__m512 acc, __m512 a, __m512 b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
};
#endif

inline __m512 round_bf16x16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(x)), 16));
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16x16(x));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

}  // namespace pagellm
