"""Triton pieces of an 8-bit KV cache (--kv-cache-dtype; attention/kv_quant.py is the torch
reference): the quantizing K/V store, and ``_dequant``, which the paged-attention kernel
(triton_kernels.py) applies to each K/V tile it loads. fp8 is handled through integer bit
operations and IEEE-half bitcasts, so it needs no fp8 hardware (nor interpreter support).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.attention.kv_quant import KVQuant

# KV_FMT (an 8-bit --kv-cache-dtype): 0 a float cache, 1 fp8 e4m3, 2 fp8 e5m2 (fp8 bits in
# uint8, times a per-tensor scale), 3 int8 with one bfloat16 scale per (token, kv head).
KV_FORMATS = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int8_per_token_head": 3}


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _round_to_bf16(x):
    # The nearest bfloat16 (ties to even) of finite float32 x, as float32: by bit operations, as
    # the interpreter's conversion truncates and the CPU kernels' and torch's round.
    u = x.to(tl.int32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_encode(x, MB: tl.constexpr, BIAS: tl.constexpr, MAXV: tl.constexpr,
                SHIFT: tl.constexpr):
    # float32 -> fp8 bits (uint8) of MB mantissa bits and exponent bias BIAS (SHIFT = 23 - MB):
    # saturated at MAXV, round to nearest even (as kernels/cpu_kv_quant.cpp).
    sign = tl.where(x < 0.0, 128, 0)
    a = tl.minimum(tl.abs(x), MAXV)
    u = a.to(tl.int32, bitcast=True)
    e = (u >> 23) - 127
    m = (u & 0x7FFFFF) >> SHIFT
    rem = u & ((1 << SHIFT) - 1)
    half = 1 << (SHIFT - 1)
    m = m + ((rem > half) | ((rem == half) & ((m & 1) == 1))).to(tl.int32)
    carry = m == (1 << MB)
    m = tl.where(carry, 0, m)
    e = e + carry.to(tl.int32)
    normal = ((e + BIAS) << MB) | m
    sub = _round_half_even(a * (2.0 ** (BIAS - 1 + MB))).to(tl.int32)
    code = tl.where(a < 2.0 ** (1 - BIAS), sub, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def _dequant(x, KV_FMT: tl.constexpr):
    # 8-bit values -> float32 (unscaled): fp8 through the bits of an IEEE half (e5m2 is a half's
    # top byte; e4m3 shifted under a half's sign comes out 2^-8 too small).
    if KV_FMT == 3:
        return x.to(tl.float32)
    w = x.to(tl.uint16)
    if KV_FMT == 2:
        return (w << 8).to(tl.float16, bitcast=True).to(tl.float32)
    h = ((w & 0x80) << 8) | ((w & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _quantize_rows(x, mask, KV_FMT: tl.constexpr, scale):
    # [heads, dim] float32 rows -> (stored values, per-row scales (int8) or None-like zeros).
    if KV_FMT == 3:
        amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
        row_scale = _round_to_bf16(amax / 127.0)  # stored as bfloat16 (exactly)
        div = tl.where(row_scale == 0.0, 1.0, row_scale)
        q = _round_half_even(x / div[:, None])
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        return q.to(tl.int8), row_scale
    if KV_FMT == 1:
        return _fp8_encode(x / scale, 3, 7, 448.0, 20), tl.zeros([x.shape[0]], tl.float32)
    return _fp8_encode(x / scale, 2, 15, 57344.0, 21), tl.zeros([x.shape[0]], tl.float32)


@triton.jit
def _reshape_and_cache_quant_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_blk, stride_kc_off, stride_kc_head,
    num_kv_heads, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, KV_FMT: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padded token: nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    hs = tl.arange(0, HEADS_PAD)
    h = hs[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask, other=0.0)
    v = tl.load(value_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask, other=0.0)
    kq, ks = _quantize_rows(k.to(tl.float32), mask, KV_FMT, k_scale)
    vq, vs = _quantize_rows(v.to(tl.float32), mask, KV_FMT, v_scale)
    dst = blk * stride_kc_blk + off * stride_kc_off + h * stride_kc_head + d
    tl.store(k_cache_ptr + dst, kq, mask=mask)
    tl.store(v_cache_ptr + dst, vq, mask=mask)
    if KV_FMT == 3:
        tl.store(k_scales_ptr + slot * num_kv_heads + hs, ks, mask=hs < num_kv_heads)
        tl.store(v_scales_ptr + slot * num_kv_heads + hs, vs, mask=hs < num_kv_heads)


def reshape_and_cache_quant(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            kv_quant: KVQuant) -> None:
    """Quantize ``key``/``value [T, Hkv, D]`` into their slots (below 0: skipped); int8 also
    writes each row's scale into ``kv_quant.k_scales``/``v_scales``."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert k_cache.is_contiguous() and v_cache.stride() == k_cache.stride()
    fmt = KV_FORMATS[kv_quant.kind]
    k_scales = kv_quant.k_scales if fmt == 3 else k_cache  # unused unless int8
    v_scales = kv_quant.v_scales if fmt == 3 else v_cache
    _reshape_and_cache_quant_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scales, v_scales, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, kv_quant.k_scale, kv_quant.v_scale,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim), KV_FMT=fmt,
    )  # fmt: skip
