"""Triton kernels over the paged KV cache: the K/V store and one unified paged attention.

Layout (see ``backend.py``): ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_dim]`` with head_dim contiguous. The attention kernel runs one program per (query block,
kv head[, kv segment]): a query block is up to ``BLOCK_Q`` consecutive new tokens of one sequence
times the ``GROUP`` query heads that share the kv head, so every K/V tile is loaded once for all
of them (GQA). Programs walk the sequence's block table ``TILE`` keys at a time with an online
softmax; rows are masked causally at ``context_len + query_pos``. Decode-only steps with few
programs may split the keys into segments (flash-decoding) and merge them in a second kernel.

Triton is imported here at module load: only ``triton_backend.py`` imports this module.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagellm.attention.kv_quant import KVQuant
from pagellm.attention.triton_kv_quant import KV_FORMATS, _dequant, reshape_and_cache_quant
from pagellm.config import read_env

_LOG2E = 1.4426950408889634


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_blk, stride_kc_off, stride_kc_head,
    stride_vc_blk, stride_vc_off, stride_vc_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padded token: nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask)
    k_dst = blk * stride_kc_blk + off * stride_kc_off + h * stride_kc_head + d
    v_dst = blk * stride_vc_blk + off * stride_vc_off + h * stride_vc_head + d
    tl.store(k_cache_ptr + k_dst, k, mask=mask)
    tl.store(v_cache_ptr + v_dst, v, mask=mask)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The interpreter multiplies bf16 tiles as raw uint16 bits: it gets fp32 operands instead.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")  # ieee: fp32 inputs must not drop to tf32


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    # Sequence i owns query blocks from query_start_loc[i] // BLOCK_Q + i on: a monotone key,
    # so the last sequence whose first block is <= q_block_idx is found by binary search.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    segm_out_ptr, segm_max_ptr, segm_sum_ptr, k_scales_ptr, v_scales_ptr,
    qk_scale, num_seqs, sliding_window, soft_cap, k_scale, v_scale, num_kv_heads,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kc_blk, stride_kc_off, stride_kc_head,
    stride_vc_blk, stride_vc_off, stride_vc_head,
    stride_bt_seq,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_PAD: tl.constexpr, TILE: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    UPCAST_DOT: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    KV_FMT: tl.constexpr,
):  # fmt: skip
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, q_block_idx, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_idx - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:  # spare program of the over-provisioned grid
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    # Row m is query token q_block * BLOCK_Q + m // GROUP, query head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_pos = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    # When GROUP does not divide BLOCK_M the spare rows would alias the next block's first token
    # (and race with its program): keep them off.
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_pos < q_len)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_pos).to(tl.int64)
    q_off = tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Keys past the last row's causal limit are never needed by this block.
    kv_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, TILE)
    # With a window, keys before the first row's window are never needed (and their blocks may
    # have been freed): the walk starts at the tile holding the first visible key.
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    first_tile = kv_start // TILE
    tile_lo = first_tile
    tile_hi = num_tiles
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(num_tiles - first_tile, NUM_SEGMENTS)
        tile_lo = first_tile + segment * per_segment
        tile_hi = tl.minimum(tile_lo + per_segment, num_tiles)

    q_abs = context_len + q_pos  # absolute position of each row's token
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for j in range(tile_lo, tile_hi):
        k_pos = j * TILE + tl.arange(0, TILE)
        # Keys below kv_start are masked out of the loads too: their blocks may be freed.
        k_ok = (k_pos < seq_len) & (k_pos >= kv_start)
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = k_pos % BLOCK_SIZE
        k_base = blk * stride_kc_blk + off * stride_kc_off + kv_head * stride_kc_head
        v_base = blk * stride_vc_blk + off * stride_vc_off + kv_head * stride_vc_head
        # Unused slots may hold NaN: masked loads read 0 there, masked scores are -inf.
        k = tl.load(
            k_cache_ptr + k_base[None, :] + offs_d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0,
        )
        if KV_FMT != 0:
            # An 8-bit cache: the tile dequantized in registers, into the query's dtype.
            if KV_FMT == 3:
                k_row_scale = tl.load(k_scales_ptr + (blk * BLOCK_SIZE + off) * num_kv_heads
                                      + kv_head, mask=k_ok, other=0.0).to(tl.float32)
                k = (_dequant(k, KV_FMT) * k_row_scale[None, :]).to(q.dtype)
            else:
                k = (_dequant(k, KV_FMT) * k_scale).to(q.dtype)
        s = _dot(q, k, UPCAST_DOT) * qk_scale  # log2 units
        if HAS_SOFT_CAP:
            # cap * tanh(x / cap) on the natural-units score x = s / log2(e), tanh written as
            # 1 - 2 / (exp(2y) + 1): finite at both ends.
            y = s / (soft_cap * 1.4426950408889634)
            s = (soft_cap * 1.4426950408889634) * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        ok = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_abs[:, None])
        if HAS_WINDOW:
            ok = ok & (k_pos[None, :] > q_abs[:, None] - sliding_window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay finite
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + v_base[:, None] + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0,
        )
        if KV_FMT != 0:
            if KV_FMT == 3:
                v_row_scale = tl.load(v_scales_ptr + (blk * BLOCK_SIZE + off) * num_kv_heads
                                      + kv_head, mask=k_ok, other=0.0).to(tl.float32)
                v = (_dequant(v, KV_FMT) * v_row_scale[:, None]).to(q.dtype)
            else:
                v = (_dequant(v, KV_FMT) * v_scale).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST_DOT)
        m_i = m_new

    if NUM_SEGMENTS > 1:
        # Partial results, merged by _merge_segments_kernel: [token, head, segment(, dim)].
        row = (tok * (tl.num_programs(1) * GROUP) + head) * NUM_SEGMENTS + segment
        tl.store(segm_max_ptr + row, m_i, mask=row_ok)
        tl.store(segm_sum_ptr + row, l_i, mask=row_ok)
        seg_off = row[:, None] * HEAD_PAD + offs_d[None, :]
        tl.store(segm_out_ptr + seg_off, acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        o_mask = row_ok[:, None] & d_ok[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr, segm_out_ptr, segm_max_ptr, segm_sum_ptr, query_start_loc_ptr, num_seqs,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, NUM_SEGMENTS: tl.constexpr, HEAD_PAD: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    if tok >= tl.load(query_start_loc_ptr + num_seqs):  # padded token
        return
    row = (tok * tl.num_programs(1) + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    m = tl.load(segm_max_ptr + row)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty segments weigh 0
    denom = tl.sum(tl.load(segm_sum_ptr + row) * w, 0)
    offs_d = tl.arange(0, HEAD_PAD)
    parts = tl.load(segm_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :])
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    o_off = tok * stride_o_tok + head * stride_o_head + offs_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.cache  # fixed for the process: Triton reads it when the kernels are first built
def _interpreting() -> bool:
    return read_env().triton_interpret


def _check_last_dim(name: str, t: torch.Tensor) -> None:
    assert t.stride(-1) == 1, f"{name} must have a contiguous last (head_dim) dimension"


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_quant: KVQuant | None = None,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots.

    Slots below 0 are skipped (padded tokens). The token dimension may be strided (a view of a
    fused QKV output); head_dim must be contiguous.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_last_dim(name, t)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache shape does not match key"
    if kv_quant is not None:
        reshape_and_cache_quant(key, value, k_cache, v_cache, slot_mapping, kv_quant)
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_seqs: int,
    max_query_len: int,
    scale: float,
    num_segments: int = 1,
    block_m: int | None = None,
    tile_size: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_quant: KVQuant | None = None,
) -> torch.Tensor:
    """Causal attention of ``query [T, Hq, D]`` over the paged cache, written into ``out``.
    ``kv_quant``: the cache holds 8-bit values (attention/kv_quant.py), dequantized per tile.

    ``sliding_window`` W: a row at position p sees keys in (p - W, p] and never reads blocks
    below its window; ``soft_cap`` c: scores become ``c * tanh(score / c)`` (see
    AttentionBackend).

    ``num_segments`` (a power of 2) > 1 splits every sequence's keys into that many parts merged
    afterwards; it is meant for decode steps with too few (sequence, kv head) pairs to fill the
    GPU. ``block_m`` (rows per program) and ``tile_size`` (keys per iteration) are tuning knobs.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert num_segments >= 1 and num_segments & (num_segments - 1) == 0, "num_segments: power of 2"
    for name, t in (("query", query), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_last_dim(name, t)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    if block_m is None:
        # Decode rows are 1 token x GROUP heads; prefill gets taller blocks for K/V reuse.
        block_m = 16 if max_query_len <= 1 else 64
    block_m = max(block_m, 16, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows
    block_q = block_m // group
    tile = tile_size or 32
    head_pad = max(16, triton.next_power_of_2(head_dim))
    # Sequence i's blocks start at query_start_loc[i] // block_q + i, so this many always suffice.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    if num_segments > 1:
        f32 = dict(dtype=torch.float32, device=query.device)
        segm_out = torch.empty(num_tokens, num_heads, num_segments, head_pad, **f32)
        segm_max = torch.empty(num_tokens, num_heads, num_segments, **f32)
        segm_sum = torch.empty(num_tokens, num_heads, num_segments, **f32)
    else:
        segm_out = segm_max = segm_sum = out  # unused
    fmt = 0 if kv_quant is None else KV_FORMATS[kv_quant.kind]
    k_scales = kv_quant.k_scales if fmt == 3 else k_cache  # unused unless int8
    v_scales = kv_quant.v_scales if fmt == 3 else v_cache
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        segm_out, segm_max, segm_sum, k_scales, v_scales,
        scale * _LOG2E, num_seqs, sliding_window or 0, soft_cap or 1.0,
        kv_quant.k_scale if kv_quant else 1.0, kv_quant.v_scale if kv_quant else 1.0,
        num_kv_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], GROUP=group, BLOCK_Q=block_q,
        BLOCK_M=block_m, HEAD_PAD=head_pad, TILE=tile,
        NUM_SEGMENTS=num_segments, UPCAST_DOT=_interpreting(),
        HAS_WINDOW=sliding_window is not None, HAS_SOFT_CAP=soft_cap is not None,
        KV_FMT=fmt,
    )  # fmt: skip
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, segm_out, segm_max, segm_sum, query_start_loc, num_seqs,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SEGMENTS=num_segments, HEAD_PAD=head_pad,
        )  # fmt: skip
    return out
