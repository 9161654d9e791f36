// Paged decode attention and KV-cache writes on the CPU, float32 and bfloat16.
//
// Decode attention is bound by reading K/V from memory, so each work item is one sequence:
// every cache row (all kv heads of a token, contiguous) is read once, block by block, with the
// next block prefetched (blocks are scattered, which defeats the hardware prefetcher at each
// block edge). Pass 1 computes the scores of all heads for a block of tokens at a time, pass 2
// accumulates V with the accumulators of a kv head's query group held in registers. Softmax and
// accumulation are float32. AVX-512 (and AVX512-BF16 dot products) where the machine has them,
// plain loops otherwise.

#include <algorithm>
#include <vector>

#include "cpu_common.h"

namespace pagellm {
namespace {

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

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

// acc[g][:] += p[g * ld + j] * v_j for the n tokens of a block; G x DC accumulators in registers.
template <typename T, int G, int DC>
void accumulate_block(float* acc, const float* p, int64_t ld, const T* vb, int64_t row,
                      int64_t n) {
  __m512 a[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) a[g][c] = _mm512_loadu_ps(acc + (g * DC + c) * 16);
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load16(vb + j * row + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * ld + j]);
      for (int c = 0; c < DC; ++c) a[g][c] = _mm512_fmadd_ps(pg, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + (g * DC + c) * 16, a[g][c]);
}
#endif

template <typename T>
void accumulate_block_generic(float* acc, const float* p, int64_t ld, int64_t G, const T* vb,
                              int64_t row, int64_t n, int64_t D) {
  using C = std::conditional_t<sizeof(T) == 2, BF16, F32>;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) {
      const float x = C::load(vb[j * row + d]);
      for (int64_t g = 0; g < G; ++g) acc[g * D + d] += p[g * ld + j] * x;
    }
}

template <typename T>
using AccumulateFn = void (*)(float*, const float*, int64_t, const T*, int64_t, int64_t);

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

template <typename C>
void decode_attention(typename C::T* out, int64_t out_stride, const typename C::T* q,
                      int64_t q_stride, const int64_t* token_rows, const typename C::T* k_cache,
                      const typename C::T* v_cache, const int32_t* block_tables,
                      int64_t bt_stride, const int32_t* seq_lens, const int64_t* seq_ids,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale) {
  using T = typename C::T;
  const int64_t H = num_heads, Hkv = num_kv_heads, G = H / Hkv, D = head_dim;
  const int64_t row = Hkv * D;  // elements per cache slot
  const int64_t block_elems = block_size * row;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(T));
  const AccumulateFn<T> accumulate = pick_accumulate<T>(G, D);
#pragma omp parallel
  {
    std::vector<float> acc(H * D), scores, inv(H);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs; ++item) {
      const int64_t s = seq_ids[item];
      const int64_t L = seq_lens[s];
      const int64_t nblocks = (L + block_size - 1) / block_size;
      const int32_t* bt = block_tables + s * bt_stride;
      const T* qrow = q + token_rows[item] * q_stride;
      scores.resize(H * L);
      // Pass 1: scores[h][t] = scale * q_h . k_t, 16 tokens at a time.
      for (int64_t b = 0; b < nblocks; ++b) {
        if (b + 1 < nblocks) prefetch_bytes(k_cache + bt[b + 1] * block_elems, block_bytes);
        const T* kb = k_cache + bt[b] * block_elems;
        const int64_t t0 = b * block_size;
        const int64_t n = std::min(L - t0, block_size);
        for (int64_t j0 = 0; j0 < n; j0 += 16)
          for (int64_t h = 0; h < H; ++h)
            block_scores<C>(scores.data() + h * L + t0 + j0, qrow + h * D,
                            kb + j0 * row + (h / G) * D, row, std::min<int64_t>(16, n - j0), D,
                            scale);
      }
      for (int64_t h = 0; h < H; ++h) inv[h] = softmax_unnormalized(scores.data() + h * L, L);
      // Pass 2: acc[h] = sum_t p[h][t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < nblocks; ++b) {
        if (b + 1 < nblocks) prefetch_bytes(v_cache + bt[b + 1] * block_elems, block_bytes);
        const T* vb = v_cache + bt[b] * block_elems;
        const int64_t t0 = b * block_size;
        const int64_t n = std::min(L - t0, block_size);
        for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
          float* a = acc.data() + kvh * G * D;
          const float* p = scores.data() + kvh * G * L + t0;
          if (accumulate != nullptr) accumulate(a, p, L, vb + kvh * D, row, n);
          else accumulate_block_generic(a, p, L, G, vb + kvh * D, row, n, D);
        }
      }
      T* orow = out + token_rows[item] * out_stride;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) orow[h * D + d] = C::store(acc[h * D + d] * inv[h]);
    }
  }
}

template <typename T>
void write_kv(T* k_cache, T* v_cache, const T* key, int64_t k_stride, const T* value,
              int64_t v_stride, const int64_t* slots, int64_t num_tokens, int64_t row) {
#pragma omp parallel for if (num_tokens > 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::memcpy(k_cache + slots[t] * row, key + t * k_stride, row * sizeof(T));
    std::memcpy(v_cache + slots[t] * row, value + t * v_stride, row * sizeof(T));
  }
}

}  // namespace
}  // namespace pagellm

using namespace pagellm;

extern "C" {

// dtype codes: 0 = float32, 1 = bfloat16
void pagellm_decode_attention(int dtype, void* out, int64_t out_stride, const void* q,
                              int64_t q_stride, const int64_t* token_rows, const void* k_cache,
                              const void* v_cache, const int32_t* block_tables, int64_t bt_stride,
                              const int32_t* seq_lens, const int64_t* seq_ids, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                              int64_t block_size, float scale) {
  if (dtype == 0)
    decode_attention<F32>(static_cast<float*>(out), out_stride, static_cast<const float*>(q),
                          q_stride, token_rows, static_cast<const float*>(k_cache),
                          static_cast<const float*>(v_cache), block_tables, bt_stride, seq_lens,
                          seq_ids, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                          scale);
  else
    decode_attention<BF16>(static_cast<uint16_t*>(out), out_stride,
                           static_cast<const uint16_t*>(q), q_stride, token_rows,
                           static_cast<const uint16_t*>(k_cache),
                           static_cast<const uint16_t*>(v_cache), block_tables, bt_stride,
                           seq_lens, seq_ids, num_seqs, num_heads, num_kv_heads, head_dim,
                           block_size, scale);
}

void pagellm_write_kv(int dtype, void* k_cache, void* v_cache, const void* key, int64_t k_stride,
                      const void* value, int64_t v_stride, const int64_t* slots,
                      int64_t num_tokens, int64_t row) {
  if (dtype == 0)
    write_kv(static_cast<float*>(k_cache), static_cast<float*>(v_cache),
             static_cast<const float*>(key), k_stride, static_cast<const float*>(value), v_stride,
             slots, num_tokens, row);
  else
    write_kv(static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache),
             static_cast<const uint16_t*>(key), k_stride, static_cast<const uint16_t*>(value),
             v_stride, slots, num_tokens, row);
}

}  // extern "C"
