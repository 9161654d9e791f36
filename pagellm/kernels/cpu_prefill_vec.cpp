// Causal attention of prefill chunks over the paged KV cache with AVX-512 vectors, for machines
// without AMX tiles (bfloat16, with AVX512-BF16 dot products) and for float32 (FMAs), flash
// style under the driver of cpu_prefill.h.
//
// Scores are kept with keys in the vector lanes: K is packed per 16 keys with the dims outermost
// (bfloat16: dim pairs x 16 keys x 2, the dot-product operand; float32: dims x 16 keys), so one
// query element (pair), broadcast, meets 16 keys per instruction. A pass takes 4 query rows of
// one head over the keys their last row sees, 64 at a time: 16 score vectors, an online
// softmax in base 2 with the scale folded in (float32), P (rounded to bfloat16 for the bfloat16
// dot products) broadcast against V packed with the dims in the lanes, accumulating the output
// rows in float32. Masked scores count as exactly zero.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"
#include "cpu_prefill.h"

namespace pagellm {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kStep = 64;  // keys per softmax step (4 vectors of scores per row)
constexpr int kRows = 4;       // query rows per pass
constexpr int64_t kMaxD = 256;

// The element type's operands (VecOps) and where the packed V of a step lies: a unit is one
// key (float32) or a key pair (bfloat16) of V.
template <typename T>
struct Vec;

template <>
struct Vec<float> : VecOps<float> {
  static inline void store_p(float* dst, __m512 p) { _mm512_store_ps(dst, p); }
  // V of key unit w of the step's packed V vt, dims [16 dd, 16 dd + 16): V is [keys][D].
  static inline const float* v_at(const float* vt, int64_t D, int64_t w, int64_t dd) {
    return vt + w * D + dd * 16;
  }
};

#if defined(__AVX512BF16__)
template <>
struct Vec<uint16_t> : VecOps<uint16_t> {
  static inline void store_p(uint16_t* dst, __m512 p) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst), to_bf16x16(p));
  }
  // V per 32 keys is [D/16][16 key pairs][16 dims][2] (pack_v_bf16).
  static inline const uint16_t* v_at(const uint16_t* vt, int64_t D, int64_t w, int64_t dd) {
    return vt + 32 * (w >> 4) * D + dd * 512 + (w & 15) * 32;
  }
};
#endif

// o[i][16 (dd0 + c) ...] = o * alpha[i] + P[i] . V for NC dim blocks from dd0 (vt: the
// step's packed V).
template <typename T, int NC>
inline void pv_chunk(float* o, int64_t D, const T* vt, const T* pbuf, const float* alpha,
                     int64_t dd0) {
  using V = Vec<T>;
  __m512 acc[kRows][NC];
  for (int i = 0; i < kRows; ++i) {
    const __m512 al = _mm512_set1_ps(alpha[i]);
    for (int c = 0; c < NC; ++c)
      acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + (dd0 + c) * 16), al);
  }
  for (int64_t w = 0; w < kStep / V::kPer; ++w) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = V::load(V::v_at(vt, D, w, dd0 + c));
    for (int i = 0; i < kRows; ++i) {
      const __m512 b = V::bcast(pbuf + i * kStep + w * V::kPer);
      for (int c = 0; c < NC; ++c) acc[i][c] = V::madd(acc[i][c], vv[c], b);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + i * D + (dd0 + c) * 16, acc[i][c]);
}

// Query rows [r0, r0 + 16) of `s` for every head of kv head h's group, kRows at a time (a
// partial pass repeats its last row, not stored).
template <typename T>
void attend_rows(const PrefillArgs& a, const PrefillSeq& s, const PackedKV<T>& kv, int64_t r0,
                 int64_t h) {
  using V = Vec<T>;
  const int64_t D = a.D, G = a.H / a.Hkv, DB = D / 16;
  const int64_t rows = std::min<int64_t>(16, s.q_len - r0);
  const int64_t first_pos = s.ctx - s.q_len;  // position of row 0
  const float c = a.scale * 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(c);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  const T* q = static_cast<const T*>(a.q);
  T* out = static_cast<T*>(a.out);
  alignas(64) float o[kRows * kMaxD];
  alignas(64) T pbuf[kRows * kStep];
  alignas(64) float m[16], mx[16], alpha[16];
  for (int64_t g = 0; g < G; ++g) {
    const int64_t head = h * G + g;
    for (int64_t rr = 0; rr < rows; rr += kRows) {
      const int64_t n = std::min<int64_t>(kRows, rows - rr);
      const T* qi[kRows];
      int64_t pos[kRows];
      for (int i = 0; i < kRows; ++i) {
        const int64_t row = r0 + rr + std::min<int64_t>(i, n - 1);
        qi[i] = q + (s.q_row + row) * a.q_stride + head * D;
        pos[i] = first_pos + row;
      }
      const int64_t steps = pos[kRows - 1] / kStep + 1;
      std::fill(o, o + kRows * D, 0.f);
      std::fill(m, m + 16, -INFINITY);
      std::fill(mx, mx + 16, 0.f);
      __m512 lsum[kRows];
      for (int i = 0; i < kRows; ++i) lsum[i] = _mm512_setzero_ps();
      for (int64_t step = 0; step < steps; ++step) {
        const int64_t k0 = step * kStep;
        // Scores of 64 keys: 4 groups of 16, each [units][16 keys].
        __m512 sc[kRows][4];
        for (int i = 0; i < kRows; ++i)
          for (int j = 0; j < 4; ++j) sc[i][j] = _mm512_setzero_ps();
        const T* kg = kv.k(step);  // the step's unit
        // Each K vector is loaded once and meets the kRows broadcast query elements at once:
        // with the rows outermost (K held for all rows) GCC reloads K for every row, which made
        // this loop load-bound (0.75x the speed of this order; the sums are the same).
        for (int64_t u = 0; u < D / V::kPer; ++u) {
          __m512 b[kRows];
          for (int i = 0; i < kRows; ++i) b[i] = V::bcast(qi[i] + u * V::kPer);
          for (int j = 0; j < 4; ++j) {
            const __m512 kj = V::load(kg + j * 16 * D + u * 16 * V::kPer);
            for (int i = 0; i < kRows; ++i) sc[i][j] = V::madd(sc[i][j], kj, b[i]);
          }
        }
        // Keys past a row's position are masked; only steps reaching past the first row's
        // position need masks at all.
        const bool full = k0 + kStep - 1 <= pos[0];
        __mmask16 mk[kRows][4];
        for (int i = 0; i < kRows; ++i) {
          if (!full) {
            const int64_t visible = std::clamp<int64_t>(pos[i] - k0 + 1, 0, kStep);
            for (int j = 0; j < 4; ++j) {
              const int64_t bits = std::clamp<int64_t>(visible - 16 * j, 0, 16);
              mk[i][j] = bits == 16 ? 0xFFFF : static_cast<__mmask16>((1u << bits) - 1);
              sc[i][j] = _mm512_mask_mov_ps(neg_inf, mk[i][j], sc[i][j]);
            }
          }
          const __m512 v = _mm512_max_ps(_mm512_max_ps(sc[i][0], sc[i][1]),
                                         _mm512_max_ps(sc[i][2], sc[i][3]));
          mx[i] = std::max(m[i], _mm512_reduce_max_ps(v));
        }
        // alpha = 2^((m_old - m_new) c); 2^(-inf) is exp2_16's clamp, 2^-125: on the first
        // step o and the sums are 0 anyway.
        const __m512 vmx = _mm512_load_ps(mx);
        _mm512_store_ps(alpha, exp2_16(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(m), vmx), vc)));
        _mm512_store_ps(m, vmx);
        for (int i = 0; i < kRows; ++i) {
          const __m512 rm = _mm512_set1_ps(mx[i] * c);
          __m512 psum = _mm512_setzero_ps();
          for (int j = 0; j < 4; ++j) {
            __m512 p = exp2_16(_mm512_fmsub_ps(sc[i][j], vc, rm));
            if (!full) p = _mm512_maskz_mov_ps(mk[i][j], p);
            psum = _mm512_add_ps(psum, p);
            V::store_p(pbuf + i * kStep + j * 16, p);
          }
          lsum[i] = _mm512_fmadd_ps(lsum[i], _mm512_set1_ps(alpha[i]), psum);
        }
        const T* vt = kv.v(step);
        for (int64_t dd = 0; dd < DB;) {
          const int64_t left = DB - dd;
          if (left >= 4) {
            pv_chunk<T, 4>(o, D, vt, pbuf, alpha, dd);
            dd += 4;
          } else if (left >= 2) {
            pv_chunk<T, 2>(o, D, vt, pbuf, alpha, dd);
            dd += 2;
          } else {
            pv_chunk<T, 1>(o, D, vt, pbuf, alpha, dd);
            dd += 1;
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(lsum[i]));
        T* dst = out + (s.q_row + r0 + rr + i) * a.out_stride + head * D;
        for (int64_t d = 0; d < D; d += 16)
          store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + d), inv));
      }
    }
  }
}

// The driver's kernel (cpu_prefill.h) for float32 or bfloat16.
template <typename E>
struct VecKernel {
  using T = E;
  static constexpr int64_t kKeyBlock = kStep;
  struct Thread {};
  static void pack(const PrefillArgs& a, const PrefillSeq& s, T* kt, T* vt, int64_t k0,
                   int64_t h) {
    const auto* kc = static_cast<const T*>(a.k_cache);
    const auto* vc = static_cast<const T*>(a.v_cache);
    const int32_t* bt = a.block_tables + s.bt_row * a.bt_stride;
    for (int64_t k = 0; k < kStep; k += 16)
      pack_k_lanes(kt + k * a.D, kc, bt, k0 + k, s.ctx, a.block_size, a.Hkv, a.D, h);
    if constexpr (sizeof(T) == 2) {
      for (int64_t k = 0; k < kStep; k += 32)
        pack_v_bf16(vt + k * a.D, vc, bt, k0 + k, s.ctx, a.block_size, a.Hkv, a.D, h);
    } else {
      for (int64_t k = 0; k < kStep; ++k) {  // V as stored, [keys][D]
        T* dst = vt + k * a.D;
        if (k0 + k < s.ctx)
          std::memcpy(dst, cache_row(vc, bt, k0 + k, a.block_size, a.Hkv, a.D, h),
                      a.D * sizeof(T));
        else
          std::memset(dst, 0, a.D * sizeof(T));
      }
    }
  }
  static void attend(const PrefillArgs& a, const PrefillSeq& s, const PackedKV<T>& kv,
                     int64_t r0, int64_t h) {
    attend_rows<T>(a, s, kv, r0, h);
  }
};
#endif  // __AVX512F__

}  // namespace

bool prefill_vec_supported(int dtype, int64_t head_dim) {
  if (head_dim <= 0 || head_dim > 256) return false;
#if defined(__AVX512F__)
  if (dtype == 0) return head_dim % 16 == 0;
#if defined(__AVX512BF16__)
  if (dtype == 1) return head_dim % 32 == 0;
#endif
#endif
  (void)dtype;
  return false;
}

void prefill_attention_vec(int dtype, const PrefillArgs& a) {
#if defined(__AVX512F__)
  if (dtype == 0) run_prefill<VecKernel<float>>(a);
#if defined(__AVX512BF16__)
  if (dtype == 1) run_prefill<VecKernel<uint16_t>>(a);
#endif
#else
  (void)dtype;
  (void)a;
#endif
}

}  // namespace pagellm
