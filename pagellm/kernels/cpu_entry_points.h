// The C entry points the fused step (cpu_decoder.cpp) calls in other files: one declaration,
// included where each is defined too, so the compiler checks every definition against it.
#pragma once

#include <cstdint>

#include "cpu_common.h"

extern "C" {
void pagellm_rms_norm(int dtype, void* out, void* residual_out, const void* x,
                      const void* residual, const void* weight, int64_t rows, int64_t hidden,
                      float eps);
int pagellm_linear(void* y, int64_t ldy, const void* x, int64_t lda, const void* w,
                   const void* bias, int64_t M, int64_t N, int64_t K);
int pagellm_linear_packed(int dtype, void* y, int64_t ldy, const void* x, int64_t lda,
                          const void* wp, const void* bias, int64_t M, int64_t N, int64_t K);
void pagellm_rotary(int dtype, void* q, int64_t q_stride, int64_t num_q_heads, void* k,
                    int64_t k_stride, int64_t num_k_heads, const int64_t* positions,
                    int64_t num_tokens, const float* cos_cache, const float* sin_cache,
                    int64_t max_pos, int64_t head_dim, int64_t rot);
int pagellm_write_kv(int dtype, void* k_cache, void* v_cache, const void* key, int64_t k_stride,
                     const void* value, int64_t v_stride, const int64_t* slots,
                     int64_t num_tokens, int64_t row, int64_t num_slots);
int pagellm_paged_attention(int dtype, void* out, int64_t out_stride, const void* q,
                            int64_t q_stride, const int64_t* token_rows, const void* k_cache,
                            const void* v_cache, const int32_t* block_tables, int64_t bt_stride,
                            const int32_t* item_lens, const int64_t* item_bt_rows,
                            int64_t num_items, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale,
                            const pagellm::CacheBounds* bounds);
int pagellm_paged_attention_windowed(int dtype, void* out, int64_t out_stride, const void* q,
                                     int64_t q_stride, const int64_t* token_rows,
                                     const void* k_cache, const void* v_cache,
                                     const int32_t* block_tables, int64_t bt_stride,
                                     const int32_t* item_lens, const int64_t* item_bt_rows,
                                     int64_t num_items, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t block_size, float scale,
                                     int64_t sliding_window, float soft_cap,
                                     const pagellm::CacheBounds* bounds);
void pagellm_silu_and_mul(int dtype, void* out, const void* x, int64_t rows, int64_t d);
int pagellm_prefill_attention(int dtype, void* out, int64_t out_stride, const void* q,
                              int64_t q_stride, const void* k_cache, const void* v_cache,
                              const int32_t* block_tables, int64_t bt_stride, int64_t num_seqs,
                              const int64_t* q_rows, const int32_t* q_lens,
                              const int32_t* ctx_lens, const int64_t* bt_rows, int64_t H,
                              int64_t Hkv, int64_t D, int64_t block_size, float scale,
                              const pagellm::CacheBounds* bounds);
}  // extern "C"
