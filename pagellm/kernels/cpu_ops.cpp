// Element-wise CPU kernels: RMSNorm (+ residual), rotary embedding, SiLU-and-mul, for float32
// and bfloat16. They round like the PyTorch ops they replace: every intermediate PyTorch
// materializes in the activation dtype is rounded to that dtype here too, so outputs match the
// torch path bit for bit up to float32 summation order.

#include <algorithm>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_entry_points.h"

namespace pagellm {
namespace {

// ---------------------------------------------------------------- RMSNorm
// out = w * round(h * rsqrt(mean(h^2) + eps)), h = x (+ residual, rounded; written back to
// residual_out when given), as transformers' LlamaRMSNorm computes it.
template <typename C>
void rms_norm(typename C::T* out, typename C::T* residual_out, const typename C::T* x,
              const typename C::T* residual, const typename C::T* weight, int64_t rows,
              int64_t hidden, float eps) {
  using T = typename C::T;
#pragma omp parallel if (rows > 8)
  {
    std::vector<float> h(hidden);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * hidden;
      float ss = 0.f;
      int64_t i0 = 0;
#if defined(__AVX512F__)
      if (residual != nullptr) {
        const T* rr = residual + r * hidden;
        T* ro = residual_out + r * hidden;
        for (; i0 + 16 <= hidden; i0 += 16) {
          __m512 sum = _mm512_add_ps(load16(xr + i0), load16(rr + i0));
          if constexpr (sizeof(T) == 2) sum = round_bf16x16(sum);
          store16(ro + i0, sum);
          _mm512_storeu_ps(h.data() + i0, sum);
        }
      } else {
        for (; i0 + 16 <= hidden; i0 += 16) _mm512_storeu_ps(h.data() + i0, load16(xr + i0));
      }
#endif
      if (residual != nullptr) {
        const T* rr = residual + r * hidden;
        T* ro = residual_out + r * hidden;
        for (int64_t i = i0; i < hidden; ++i) {
          const T sum = C::store(C::load(xr[i]) + C::load(rr[i]));
          ro[i] = sum;
          h[i] = C::load(sum);
        }
      } else {
        for (int64_t i = i0; i < hidden; ++i) h[i] = C::load(xr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; i + 16 <= hidden; i += 16) {
        __m512 y = _mm512_mul_ps(_mm512_loadu_ps(h.data() + i), vinv);
        if constexpr (sizeof(T) == 2) y = round_bf16x16(y);
        store16(o + i, _mm512_mul_ps(load16(weight + i), y));
      }
#endif
      for (; i < hidden; ++i) o[i] = C::store(C::load(weight[i]) * C::round(h[i] * inv));
    }
  }
}

// ---------------------------------------------------------------- rotary (rotate-half)
// In place on q [T, Hq * D] and k [T, Hk * D] (row strides given), cos/sin float32
// [max_pos, rot / 2] rounded to the activation dtype first, like the torch path.
template <typename C>
void rotary(typename C::T* q, int64_t q_stride, int64_t num_q_heads, typename C::T* k,
            int64_t k_stride, int64_t num_k_heads, const int64_t* positions, int64_t num_tokens,
            const float* cos_cache, const float* sin_cache, int64_t max_pos, int64_t head_dim,
            int64_t rot) {
  using T = typename C::T;
  const int64_t half = rot / 2;
#pragma omp parallel if (num_tokens > 16)
  {
    std::vector<float> c(half), s(half);
#pragma omp for
    for (int64_t t = 0; t < num_tokens; ++t) {
      const int64_t pos = positions[t];
      if (pos < 0 || pos >= max_pos) {  // never read outside the table: poison the row instead
        std::fill(c.begin(), c.end(), NAN);
        std::fill(s.begin(), s.end(), NAN);
      } else {
        for (int64_t i = 0; i < half; ++i) {
          c[i] = C::round(cos_cache[pos * half + i]);
          s[i] = C::round(sin_cache[pos * half + i]);
        }
      }
      for (int64_t which = 0; which < 2; ++which) {
        T* base = which == 0 ? q + t * q_stride : k + t * k_stride;
        const int64_t heads = which == 0 ? num_q_heads : num_k_heads;
        for (int64_t h = 0; h < heads; ++h) {
          T* x = base + h * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = C::load(x[i]), x2 = C::load(x[i + half]);
            const float a = C::round(x1 * c[i]), b = C::round(x2 * s[i]);
            const float e = C::round(x2 * c[i]), f = C::round(x1 * s[i]);
            x[i] = C::store(a - b);
            x[i + half] = C::store(e + f);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- SiLU and mul
template <typename C>
void silu_and_mul(typename C::T* out, const typename C::T* x, int64_t rows, int64_t d) {
  using T = typename C::T;
#pragma omp parallel for if (rows * d > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = x + r * 2 * d;
    const T* u = g + d;
    T* o = out + r * d;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16) {
      const __m512 gv = load16(g + i);
      __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f),
                                                 exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      if constexpr (sizeof(T) == 2) s = round_bf16x16(s);
      store16(o + i, _mm512_mul_ps(s, load16(u + i)));
    }
#endif
    for (; i < d; ++i) {
      const float gv = C::load(g[i]);
      o[i] = C::store(C::round(gv / (1.f + std::exp(-gv))) * C::load(u[i]));
    }
  }
}

// ---------------------------------------------------------------- argmax of rows
// out[r] = the first index of the largest value of row r, or of its first NaN (torch.argmax's
// answer: NaN counts as the largest). One pass over bf16 logits, no float32 copy.
template <typename C>
void argmax_rows(int64_t* out, const typename C::T* x, int64_t rows, int64_t cols,
                 int64_t stride) {
  using T = typename C::T;
#pragma omp parallel for if (rows * cols > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * stride;
    int64_t i = 0, best = 0;
    float best_v = -INFINITY;
    bool nan = false;
#if defined(__AVX512F__)
    if (cols >= 16) {
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      __m512i vidx = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                                      9, 10, 11, 12, 13, 14, 15);
      __mmask16 unordered = 0;
      const __m512i step = _mm512_set1_epi32(16);
      for (; i + 16 <= cols; i += 16) {
        const __m512 v = load16(xr + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);  // strict: first wins
        vmax = _mm512_mask_mov_ps(vmax, gt, v);
        vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
        cur = _mm512_add_epi32(cur, step);
      }
      nan = unordered != 0;
      alignas(64) float mv[16];
      alignas(64) int32_t mi[16];
      _mm512_store_ps(mv, vmax);
      _mm512_store_si512(mi, vidx);
      best_v = mv[0];
      best = mi[0];
      for (int l = 1; l < 16; ++l)
        if (mv[l] > best_v || (mv[l] == best_v && mi[l] < best)) {
          best_v = mv[l];
          best = mi[l];
        }
    }
#endif
    for (; i < cols && !nan; ++i) {
      const float v = C::load(xr[i]);
      if (v != v) nan = true;
      else if (v > best_v) {
        best_v = v;
        best = i;
      }
    }
    if (nan) {
      for (int64_t j = 0; j < cols; ++j) {
        const float v = C::load(xr[j]);
        if (v != v) {
          best = j;
          break;
        }
      }
    }
    out[r] = best;
  }
}

}  // namespace
}  // namespace pagellm

using namespace pagellm;

extern "C" {

int pagellm_abi_version() { return 10; }

// The kernel paths this build compiled, as bits: 1 AMX (built, and granted to this process),
// 2 AVX-512 BF16, 4 AVX-512; the plain loops (generic) are always built. A path a kernel
// cannot take for a shape falls back to the next one down.
int pagellm_kernel_paths() {
  int bits = 0;
#if defined(PAGELLM_AMX)
  if (amx_permitted()) bits |= 1;
#endif
#if defined(__AVX512BF16__)
  bits |= 2;
#endif
#if defined(__AVX512F__)
  bits |= 4;
#endif
  return bits;
}

// dtype codes: 0 = float32, 1 = bfloat16
void pagellm_rms_norm(int dtype, void* out, void* residual_out, const void* x,
                      const void* residual, const void* weight, int64_t rows, int64_t hidden,
                      float eps) {
  if (dtype == 0)
    rms_norm<F32>(static_cast<float*>(out), static_cast<float*>(residual_out),
                  static_cast<const float*>(x), static_cast<const float*>(residual),
                  static_cast<const float*>(weight), rows, hidden, eps);
  else
    rms_norm<BF16>(static_cast<uint16_t*>(out), static_cast<uint16_t*>(residual_out),
                   static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
                   static_cast<const uint16_t*>(weight), rows, hidden, eps);
}

void pagellm_rotary(int dtype, void* q, int64_t q_stride, int64_t num_q_heads, void* k,
                    int64_t k_stride, int64_t num_k_heads, const int64_t* positions,
                    int64_t num_tokens, const float* cos_cache, const float* sin_cache,
                    int64_t max_pos, int64_t head_dim, int64_t rot) {
  if (dtype == 0)
    rotary<F32>(static_cast<float*>(q), q_stride, num_q_heads, static_cast<float*>(k), k_stride,
                num_k_heads, positions, num_tokens, cos_cache, sin_cache, max_pos, head_dim, rot);
  else
    rotary<BF16>(static_cast<uint16_t*>(q), q_stride, num_q_heads, static_cast<uint16_t*>(k),
                 k_stride, num_k_heads, positions, num_tokens, cos_cache, sin_cache, max_pos,
                 head_dim, rot);
}

void pagellm_silu_and_mul(int dtype, void* out, const void* x, int64_t rows, int64_t d) {
  if (dtype == 0)
    silu_and_mul<F32>(static_cast<float*>(out), static_cast<const float*>(x), rows, d);
  else
    silu_and_mul<BF16>(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), rows, d);
}

void pagellm_argmax_rows(int dtype, int64_t* out, const void* x, int64_t rows, int64_t cols,
                         int64_t stride) {
  if (dtype == 0)
    argmax_rows<F32>(out, static_cast<const float*>(x), rows, cols, stride);
  else
    argmax_rows<BF16>(out, static_cast<const uint16_t*>(x), rows, cols, stride);
}

}  // extern "C"
