// A step through every decoder layer of a Llama-style model in one call (bfloat16 or float32).
//
// With few tokens per step the model's own work is small next to the Python around each op
// (a dozen module calls and kernel wrappers per layer: a fixed cost per step whatever its
// size, at batch 1 about as much as reading the weights). This runs the same kernels in the
// same order as the modules do (RMSNorm + residual, QKV projection, rotary, K/V write, paged
// attention of the decode tokens, prefill attention of the prefill chunks, output projection,
// RMSNorm + residual, gate/up projection, SiLU-and-mul, down projection; the final norm), so
// its results are bit-identical to theirs; the caller only sends steps whose every projection
// one linear kernel serves (AMX on the plain bfloat16 weights, or the AVX-512 kernel on packed
// weights of either dtype) and whose prefill chunks (if any) the prefill kernel takes.
// With an 8-bit KV cache (pagellm_llama_forward_quant) the K/V write and attention are the
// quantized cache's kernels (cpu_kv_quant.cpp), every sequence of the step in one call, as the
// CPU attention backend runs them (_forward_quant).
#include <cstdint>
#include <cstring>

#include "cpu_common.h"
#include "cpu_entry_points.h"
#include "cpu_kv_quant.h"

extern "C" {
// One layer's tensors (biases may be null).
struct PagellmLlamaLayer {
  const void* input_norm;
  const void* qkv;
  const void* qkv_bias;
  const void* o;
  const void* o_bias;
  const void* post_norm;
  const void* gate_up;
  const void* gate_up_bias;
  const void* down;
  const void* down_bias;
  void* k_cache;
  void* v_cache;
};

// dtype: 0 = float32, 1 = bfloat16; packed: 1 where the projections' weights are packed for
// pagellm_linear_packed, 0 where they are plain bfloat16 weights for the AMX pagellm_linear.
struct PagellmLlamaShape {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
  int64_t rot_dim, max_pos, block_size;
  float eps, scale;
  int64_t dtype, packed;
};

// One step: `hidden` [T, hidden] holds the embeddings and gets the final normed states; the
// other buffers are scratch of their natural shapes. Attention as the CPU backend plans it:
// one paged-attention item per decode token, one prefill-attention sequence per chunk.
struct PagellmForwardStep {
  int64_t num_tokens;
  void* hidden;
  void* residual;
  void* normed;
  void* qkv;
  void* attn;
  void* gate_up;
  void* act;
  const int64_t* positions;
  const int64_t* slots;
  const float* cos_cache;
  const float* sin_cache;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* lens;
  const int64_t* bt_rows;
  const int64_t* token_rows;
  int64_t num_items;
  const void* final_norm;
  int64_t num_prefill;
  const int64_t* prefill_rows;
  const int32_t* prefill_lens;
  const int32_t* prefill_ctx;
  const int64_t* prefill_bt_rows;
  int64_t num_blocks;  // blocks in each layer's cache
  int64_t bt_height;   // rows of block_tables
  int64_t bt_width;    // entries per row of block_tables
};

// An 8-bit cache's step (fmt as pagellm_write_kv_quant's): per layer its int8 scale tables
// (null for fp8) and per-tensor scales; every sequence of the step as (first row, rows, cached
// tokens after the step, block-table row), decode tokens and prefill chunks alike.
struct PagellmKVQuantLayer {
  void* k_scales;
  void* v_scales;
  float k_scale, v_scale;
};

struct PagellmKVQuantStep {
  int64_t fmt;
  const PagellmKVQuantLayer* layers;
  int64_t num_seqs;
  const int64_t* q_rows;
  const int32_t* q_lens;
  const int32_t* seq_lens;
  const int64_t* bt_rows;
};

}  // extern "C"

namespace {

template <typename T>
int llama_forward(const PagellmLlamaLayer* layers, int64_t num_layers,
                  const PagellmLlamaShape& d, const PagellmForwardStep& s,
                  const PagellmKVQuantStep* kq) {
  const int dt = static_cast<int>(d.dtype);
  const int64_t T_ = s.num_tokens, H = d.hidden, D = d.head_dim;
  const int64_t q = d.num_heads * D, kv = d.num_kv_heads * D, qkv_w = q + 2 * kv;
  const int64_t I = d.intermediate;
  auto* hidden = static_cast<T*>(s.hidden);
  auto* residual = static_cast<T*>(s.residual);
  auto* normed = static_cast<T*>(s.normed);
  auto* qkv = static_cast<T*>(s.qkv);
  const pagellm::CacheBounds bounds{s.num_blocks, s.bt_height, s.bt_width, T_};
  auto linear = [&](void* y, int64_t ldy, const void* x, int64_t lda, const void* w,
                    const void* bias, int64_t N, int64_t K) {
    return d.packed ? pagellm_linear_packed(dt, y, ldy, x, lda, w, bias, T_, N, K)
                    : pagellm_linear(y, ldy, x, lda, w, bias, T_, N, K);
  };
  for (int64_t l = 0; l < num_layers; ++l) {
    const PagellmLlamaLayer& w = layers[l];
    if (l == 0) {
      std::memcpy(residual, hidden, T_ * H * sizeof(T));
      pagellm_rms_norm(dt, normed, nullptr, hidden, nullptr, w.input_norm, T_, H, d.eps);
    } else {
      pagellm_rms_norm(dt, normed, residual, hidden, residual, w.input_norm, T_, H, d.eps);
    }
    // Every kernel's answer is passed on: 0 (cannot take the step) or kOutOfBounds.
    int rc = linear(qkv, qkv_w, normed, H, w.qkv, w.qkv_bias, qkv_w, H);
    if (rc != 1) return rc;
    pagellm_rotary(dt, qkv, qkv_w, d.num_heads, qkv + q, qkv_w, d.num_kv_heads, s.positions, T_,
                   s.cos_cache, s.sin_cache, d.max_pos, D, d.rot_dim);
    if (kq != nullptr) {
      const PagellmKVQuantLayer& ql = kq->layers[l];
      const int fmt = static_cast<int>(kq->fmt);
      auto* ks = static_cast<uint16_t*>(ql.k_scales);
      auto* vs = static_cast<uint16_t*>(ql.v_scales);
      rc = pagellm_write_kv_quant(fmt, dt, w.k_cache, w.v_cache, ks, vs, qkv + q, qkv_w,
                                  qkv + q + kv, qkv_w, s.slots, T_, d.num_kv_heads, D,
                                  s.num_blocks * d.block_size, ql.k_scale, ql.v_scale);
      if (rc != 1) return rc;
      if (kq->num_seqs) {
        rc = pagellm_paged_attention_quant(
            fmt, dt, s.attn, q, qkv, qkv_w, w.k_cache, w.v_cache, ks, vs, s.block_tables,
            s.bt_stride, kq->num_seqs, kq->q_rows, kq->q_lens, kq->seq_lens, kq->bt_rows,
            d.num_heads, d.num_kv_heads, D, d.block_size, d.scale, 0, 0.f, ql.k_scale,
            ql.v_scale, &bounds);
        if (rc != 1) return rc;
      }
    } else {
      rc = pagellm_write_kv(dt, w.k_cache, w.v_cache, qkv + q, qkv_w, qkv + q + kv, qkv_w,
                            s.slots, T_, kv, s.num_blocks * d.block_size);
      if (rc != 1) return rc;
    }
    if (kq == nullptr && s.num_items) {
      rc = pagellm_paged_attention(dt, s.attn, q, qkv, qkv_w, s.token_rows, w.k_cache, w.v_cache,
                                   s.block_tables, s.bt_stride, s.lens, s.bt_rows, s.num_items,
                                   d.num_heads, d.num_kv_heads, D, d.block_size, d.scale,
                                   &bounds);
      if (rc != 1) return rc;
    }
    if (kq == nullptr && s.num_prefill) {
      rc = pagellm_prefill_attention(dt, s.attn, q, qkv, qkv_w, w.k_cache, w.v_cache,
                                     s.block_tables, s.bt_stride, s.num_prefill, s.prefill_rows,
                                     s.prefill_lens, s.prefill_ctx, s.prefill_bt_rows,
                                     d.num_heads, d.num_kv_heads, D, d.block_size, d.scale,
                                     &bounds);
      if (rc != 1) return rc;
    }
    if ((rc = linear(hidden, H, s.attn, q, w.o, w.o_bias, H, q)) != 1) return rc;
    pagellm_rms_norm(dt, normed, residual, hidden, residual, w.post_norm, T_, H, d.eps);
    if ((rc = linear(s.gate_up, 2 * I, normed, H, w.gate_up, w.gate_up_bias, 2 * I, H)) != 1)
      return rc;
    pagellm_silu_and_mul(dt, s.act, s.gate_up, T_, I);
    if ((rc = linear(hidden, H, s.act, I, w.down, w.down_bias, H, I)) != 1) return rc;
  }
  pagellm_rms_norm(dt, hidden, residual, hidden, residual, s.final_norm, T_, H, d.eps);
  return 1;
}

}  // namespace

extern "C" {

// Returns 1; 0 (with the caches possibly written) where the linear kernel or, with prefill
// chunks, the prefill kernel cannot take the step (the caller checks both first), or the
// attention kernels refuse the shape (attention_shape_ok); kOutOfBounds where a slot, block id,
// block-table row or length lies outside the step's bounds (nothing read or written outside).
int pagellm_llama_forward(const PagellmLlamaLayer* layers, int64_t num_layers,
                          const PagellmLlamaShape* shape, const PagellmForwardStep* step) {
  return shape->dtype == 0 ? llama_forward<float>(layers, num_layers, *shape, *step, nullptr)
                           : llama_forward<uint16_t>(layers, num_layers, *shape, *step, nullptr);
}

// pagellm_llama_forward over 8-bit KV caches (layers[l].k_cache/v_cache hold the 8-bit values,
// `quant` the rest); the step's attention items are quant's sequences (step's decode items and
// prefill chunks are not read). Returns as pagellm_llama_forward, 0 also for a format the
// quantized kernels refuse.
int pagellm_llama_forward_quant(const PagellmLlamaLayer* layers, int64_t num_layers,
                                const PagellmLlamaShape* shape, const PagellmForwardStep* step,
                                const PagellmKVQuantStep* quant) {
  return shape->dtype == 0 ? llama_forward<float>(layers, num_layers, *shape, *step, quant)
                           : llama_forward<uint16_t>(layers, num_layers, *shape, *step, quant);
}

}  // extern "C"
