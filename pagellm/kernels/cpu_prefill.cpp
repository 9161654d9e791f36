// Causal attention of prefill chunks over the paged KV cache, flash style: the entry point, and
// the AMX (bfloat16) kernel; the AVX-512 kernels for machines without AMX and for float32 are in
// cpu_prefill_vec.cpp, the driver both run under in cpu_prefill.h.
//
// AMX: K/V are regrouped per 32-key unit and kv head (shared where sequences share blocks, see
// cpu_prefill.h) into tiles: K transposed as dim pairs x 16 keys, the B operand of the scores;
// V as key pairs x 16 dims, the B operand of P.V. Then each work item, 16 query rows of one
// sequence and kv head, runs every query head of that group over the keys its last row may see,
// 32 at a time (one unit): two score tiles, an online softmax in float32 (AVX-512), P rounded to
// bfloat16 as the A tile, P.V into float32 accumulators. Masked scores count as exactly zero;
// sums and the output are float32 until the final bfloat16 rounding.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_entry_points.h"
#include "cpu_prefill.h"

namespace pagellm {
namespace {

#if defined(PAGELLM_AMX)
constexpr int64_t kTile = 512;  // bf16 elements per tile

// 16 query rows [r0, r0 + 16) of `s` (rows past q_len repeat the last one, not stored) for
// every head of kv head h's group.
void attend_block(uint16_t* out, int64_t out_stride, const uint16_t* q, int64_t q_stride,
                  const PrefillSeq& s, const PackedKV<uint16_t>& kv, int64_t r0, int64_t h,
                  int64_t G, int64_t D, float scale) {
  const int64_t rows = std::min<int64_t>(16, s.q_len - r0);
  const int64_t first_pos = s.ctx - s.q_len;  // position of row 0
  // Keys the block's last row sees, in 32-key steps.
  const int64_t last_key = first_pos + r0 + rows - 1;
  const int64_t steps = last_key / 32 + 1;
  const int64_t halves = D / 32, dblocks = D / 16;
  alignas(64) uint16_t qbuf[16 * 256];
  alignas(64) float sc[16 * 32];
  alignas(64) uint16_t pb[16 * 32];
  alignas(64) float pv[16 * 64];
  std::vector<float> o(16 * D);
  alignas(64) float m[16], l[16], alpha[16];  // m: running row maxima (unscaled scores)
  const float c = scale * 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(c);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t head = h * G + g;
    // Query rows (a partial block copied, its missing rows repeating the last one).
    const uint16_t* qa = q + (s.q_row + r0) * q_stride + head * D;
    int64_t qa_stride = q_stride;
    if (rows < 16) {
      for (int64_t r = 0; r < 16; ++r)
        std::memcpy(qbuf + r * D, qa + std::min(r, rows - 1) * q_stride, D * 2);
      qa = qbuf;
      qa_stride = D;
    }
    std::fill(o.begin(), o.end(), 0.f);
    std::fill(m, m + 16, -INFINITY);
    std::fill(l, l + 16, 0.f);
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t k0 = step * 32;
      // Scores: keys [k0, k0 + 16) in tile 0, [k0 + 16, k0 + 32) in tile 1.
      _tile_zero(0);
      _tile_zero(1);
      // The step's unit: keys [k0, k0 + 16) then [k0 + 16, k0 + 32), halves * kTile each.
      const uint16_t* ka = kv.k(step);
      const uint16_t* kb = ka + halves * kTile;
      for (int64_t half = 0; half < halves; ++half) {
        _tile_loadd(6, qa + half * 32, qa_stride * 2);
        _tile_loadd(4, ka + half * kTile, 64);
        _tile_loadd(5, kb + half * kTile, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(1, 6, 5);
      }
      _tile_stored(0, sc, 128);
      _tile_stored(1, sc + 16, 128);
      // Online softmax per row, in base 2 with the scale folded in (p = 2^(s c - m c), c =
      // scale log2 e; the row maxima m are kept unscaled). Keys past a row's position are
      // masked; only steps reaching past the block's first row need masks at all.
      const bool full = k0 + 31 <= first_pos + r0;
      __mmask16 mask0[16], mask1[16];
      alignas(64) float mx[16];
      for (int64_t r = 0; r < 16; ++r) {
        __m512 s0 = _mm512_loadu_ps(sc + r * 32), s1 = _mm512_loadu_ps(sc + r * 32 + 16);
        if (!full) {
          const int64_t pos = first_pos + r0 + std::min(r, rows - 1);
          // Keys of this step the row sees: none for an early row of a block on the diagonal
          // (its maximum is then already finite: key 0 is visible to every row at step 0).
          const int64_t visible = std::clamp<int64_t>(pos - k0 + 1, 0, 32);
          mask0[r] = visible >= 16 ? 0xFFFF : (__mmask16)((1u << visible) - 1);
          mask1[r] = visible >= 32 ? 0xFFFF
                     : visible <= 16 ? 0 : (__mmask16)((1u << (visible - 16)) - 1);
          s0 = _mm512_mask_mov_ps(neg_inf, mask0[r], s0);
          s1 = _mm512_mask_mov_ps(neg_inf, mask1[r], s1);
          _mm512_storeu_ps(sc + r * 32, s0);
          _mm512_storeu_ps(sc + r * 32 + 16, s1);
        }
        mx[r] = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      }
      // 2^(-inf) is exp2_16's clamp, 2^-125: the first step's o and l are 0 anyway.
      const __m512 vmx = _mm512_load_ps(mx);
      _mm512_store_ps(alpha, exp2_16(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(m), vmx), vc)));
      _mm512_store_ps(m, vmx);
      for (int64_t r = 0; r < 16; ++r) {
        const __m512 rm = _mm512_set1_ps(mx[r] * c);
        // Masked scores are -inf: 2^(-inf) clamps to 2^-125, zeroed by the masks below.
        __m512 p0 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(sc + r * 32), vc, rm));
        __m512 p1 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(sc + r * 32 + 16), vc, rm));
        if (!full) {
          p0 = _mm512_maskz_mov_ps(mask0[r], p0);
          p1 = _mm512_maskz_mov_ps(mask1[r], p1);
        }
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        _mm256_storeu_si256((__m256i*)(pb + r * 32), to_bf16x16(p0));
        _mm256_storeu_si256((__m256i*)(pb + r * 32 + 16), to_bf16x16(p1));
      }
      // P.V, 4 dim blocks (64 dims) at a time, then o = o * alpha + P.V.
      _tile_loadd(5, pb, 64);
      const uint16_t* vb = kv.v(step);
      for (int64_t d0 = 0; d0 < dblocks; d0 += 4) {
        const int64_t n = std::min<int64_t>(4, dblocks - d0);
        _tile_zero(0);
        _tile_loadd(4, vb + d0 * kTile, 64);
        _tile_dpbf16ps(0, 5, 4);
        _tile_stored(0, pv, 256);
        if (n > 1) {
          _tile_zero(1);
          _tile_loadd(4, vb + (d0 + 1) * kTile, 64);
          _tile_dpbf16ps(1, 5, 4);
          _tile_stored(1, pv + 16, 256);
        }
        if (n > 2) {
          _tile_zero(2);
          _tile_loadd(4, vb + (d0 + 2) * kTile, 64);
          _tile_dpbf16ps(2, 5, 4);
          _tile_stored(2, pv + 32, 256);
        }
        if (n > 3) {
          _tile_zero(3);
          _tile_loadd(4, vb + (d0 + 3) * kTile, 64);
          _tile_dpbf16ps(3, 5, 4);
          _tile_stored(3, pv + 48, 256);
        }
        for (int64_t r = 0; r < 16; ++r) {
          const __m512 a = _mm512_set1_ps(alpha[r]);
          float* orow = o.data() + r * D + d0 * 16;
          for (int64_t j = 0; j < n; ++j)
            _mm512_storeu_ps(orow + j * 16, _mm512_fmadd_ps(_mm512_loadu_ps(orow + j * 16), a,
                                                            _mm512_loadu_ps(pv + r * 64 + j * 16)));
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      uint16_t* dst = out + (s.q_row + r0 + r) * out_stride + head * D;
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i*)(dst + d),
                            to_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(o.data() + r * D + d), inv)));
    }
  }
}

struct AmxKernel {
  using T = uint16_t;
  static constexpr int64_t kKeyBlock = 32;
  using Thread = FullTiles;
  static void pack(const PrefillArgs& a, const PrefillSeq& s, T* kt, T* vt, int64_t k0,
                   int64_t h) {
    const auto* kc = static_cast<const uint16_t*>(a.k_cache);
    const auto* vc = static_cast<const uint16_t*>(a.v_cache);
    const int32_t* bt = a.block_tables + s.bt_row * a.bt_stride;
    for (int64_t k = 0; k < 32; k += 16)
      pack_k_lanes(kt + k * a.D, kc, bt, k0 + k, s.ctx, a.block_size, a.Hkv, a.D, h);
    pack_v_bf16(vt, vc, bt, k0, s.ctx, a.block_size, a.Hkv, a.D, h);
  }
  static void attend(const PrefillArgs& a, const PrefillSeq& s, const PackedKV<T>& kv,
                     int64_t r0, int64_t h) {
    attend_block(static_cast<uint16_t*>(a.out), a.out_stride,
                 static_cast<const uint16_t*>(a.q), a.q_stride, s, kv, r0, h, a.H / a.Hkv, a.D,
                 a.scale);
  }
};
#endif

bool amx_supported(int dtype, int64_t head_dim) {
#if defined(PAGELLM_AMX)
  return dtype == 1 && amx_permitted() && head_dim % 32 == 0 && head_dim <= 256;
#else
  (void)dtype;
  (void)head_dim;
  return false;
#endif
}

}  // namespace
}  // namespace pagellm

extern "C" {

// Whether pagellm_prefill_attention takes this dtype (0 = float32, 1 = bfloat16) and head size
// here: bfloat16 with AMX granted, else the AVX-512 kernels (cpu_prefill_vec.cpp).
int pagellm_prefill_attention_supported(int dtype, int64_t head_dim) {
  return pagellm::amx_supported(dtype, head_dim) ||
         pagellm::prefill_vec_supported(dtype, head_dim);
}

// Sequence i's rows [q_rows[i], q_rows[i] + q_lens[i]) of q [*, H, D] (row stride q_stride) are
// the last q_lens[i] of its ctx_lens[i] cached tokens (K/V already written, block table row
// bt_rows[i]); each attends causally to the cache and is written at the same row of out.
// Returns 0, doing nothing, where pagellm_prefill_attention_supported is 0 or the shape is one
// the kernels cannot index (attention_shape_ok); kOutOfBounds, doing nothing, where a chunk's
// rows, length or blocks lie outside `bounds`.
int pagellm_prefill_attention(int dtype, void* out, int64_t out_stride, const void* q,
                              int64_t q_stride, const void* k_cache, const void* v_cache,
                              const int32_t* block_tables, int64_t bt_stride, int64_t num_seqs,
                              const int64_t* q_rows, const int32_t* q_lens,
                              const int32_t* ctx_lens, const int64_t* bt_rows, int64_t H,
                              int64_t Hkv, int64_t D, int64_t block_size, float scale,
                              const pagellm::CacheBounds* bounds) {
  using namespace pagellm;
  if (!attention_shape_ok(H, Hkv, D, block_size) || num_seqs < 0) return 0;
  // Every chunk's rows, length and blocks inside the bounds before any is read.
  for (int64_t i = 0; i < num_seqs; ++i)
    if (q_lens[i] < 1 || q_lens[i] > ctx_lens[i] || !bounds->rows_ok(q_rows[i], q_lens[i]) ||
        !bounds->sequence_ok(block_tables, bt_stride, bt_rows[i], ctx_lens[i], block_size))
      return kOutOfBounds;
  const PrefillArgs a{out,      out_stride, q,       q_stride, k_cache, v_cache, block_tables,
                      bt_stride, num_seqs,  q_rows,  q_lens,   ctx_lens, bt_rows, H,
                      Hkv,      D,          block_size, scale};
#if defined(PAGELLM_AMX)
  if (amx_supported(dtype, D)) {
    run_prefill<AmxKernel>(a);
    return 1;
  }
#endif
  if (!prefill_vec_supported(dtype, D)) return 0;
  prefill_attention_vec(dtype, a);
  return 1;
}

}  // extern "C"
