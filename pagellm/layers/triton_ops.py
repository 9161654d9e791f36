"""Triton kernels for the small per-layer ops on CUDA: RMSNorm (+ residual), rotary, SiLU-and-mul.

Each replaces several torch launches (and their temporaries) with one kernel that rounds exactly
where the torch path does: every intermediate the torch path keeps in the activation dtype is
rounded to that dtype (round-to-nearest-even, done with integer ops for bfloat16 so that the
interpreter, whose float32->bfloat16 cast truncates, gives the GPU's bits), while sums of squares
and the like stay float32. On bfloat16 the results then match torch up to the last-ulp effects of
reduction order and of ``exp``.

Triton is imported at module load: the layers import this module lazily, only for CUDA tensors.
On CPU tensors the kernels run under ``TRITON_INTERPRET=1`` (tests). One program per row/token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Activation dtype codes for _round (a constexpr, so each dtype compiles its own variant).
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SILU_BLOCK = 1024


@triton.jit
def _round(x, DT: tl.constexpr):
    """float32 ``x`` rounded to the activation dtype (nearest even), returned as float32."""
    if DT == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    elif DT == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_out, stride_res,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, DT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, DT)  # the add happens in the activation dtype
        tl.store(res_out_ptr + row * stride_res + cols,
                 x.to(res_out_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / hidden
    h = _round(x * tl.rsqrt(var + eps), DT)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(w * h, DT)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    base, num_heads, cos, sin, half_idx, half_mask,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, HEADS_PAD)
    offs = heads[:, None] * HEAD_DIM + half_idx[None, :]
    mask = (heads < num_heads)[:, None] & half_mask[None, :]
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    # As torch in the activation dtype: each product rounded, then the sum rounded.
    o1 = _round(_round(x1 * c, DT) - _round(x2 * s, DT), DT)
    o2 = _round(_round(x2 * c, DT) + _round(x1 * s, DT), DT)
    tl.store(base + offs, o1.to(base.dtype.element_ty), mask=mask)
    tl.store(base + offs + HALF, o2.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_q, stride_k, stride_cs,
    num_q_heads, num_k_heads, max_pos,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    QH_PAD: tl.constexpr, KH_PAD: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    imask = i < HALF
    # A position outside the table rotates to NaN, as the CPU kernel does; row 0 is read instead.
    inside = (pos >= 0) & (pos < max_pos)
    row = tl.where(inside, pos, 0)
    # The float32 table cast to the activation dtype, as the torch path does.
    cos = _round(tl.load(cos_ptr + row * stride_cs + i, mask=imask, other=0.0), DT)
    sin = _round(tl.load(sin_ptr + row * stride_cs + i, mask=imask, other=0.0), DT)
    cos = tl.where(inside, cos, float("nan"))
    sin = tl.where(inside, sin, float("nan"))
    _rotate_heads(q_ptr + tok * stride_q, num_q_heads, cos, sin, i, imask,
                  HEAD_DIM, HALF, QH_PAD, DT)
    _rotate_heads(k_ptr + tok * stride_k, num_k_heads, cos, sin, i, imask,
                  HEAD_DIM, HALF, KH_PAD, DT)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, d,
    DT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), DT)  # silu's output is in the activation dtype
    y = _round(s * u, DT)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def supports(*tensors: torch.Tensor) -> bool:
    """True when the kernels take these tensors: one float dtype, unit stride in the last dim."""
    dtype = tensors[0].dtype
    return dtype in _DT and all(t.dtype == dtype and t.stride(-1) == 1 for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D [rows, last] tensor with unit last stride (a view when possible)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def _norm_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(x [+ residual]), x + residual or None)``, new tensors shaped like ``x``."""
    hidden = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = res_out = None
    if residual is not None:
        r2 = _rows(residual)
        assert r2.shape == x2.shape
        res_out = torch.empty_like(out)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2 if r2 is None else r2, weight, out, out if res_out is None else res_out,
            x2.stride(0), x2.stride(0) if r2 is None else r2.stride(0), out.stride(0),
            out.stride(0), hidden, eps,
            HAS_RESIDUAL=r2 is not None, DT=_DT[x.dtype], BLOCK=block,
            num_warps=_norm_warps(block),
        )  # fmt: skip
    out = out.view(x.shape)
    return out, None if res_out is None else res_out.view(x.shape)


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
            sin_cache: torch.Tensor, head_dim: int) -> None:
    """Rotate-half rotary in place on ``q [T, Hq*D]`` and ``k [T, Hk*D]`` (row strides free, e.g.
    views of the QKV projection) by ``positions [T]``; only the first ``2 * cos_cache.shape[1]``
    dims of each head turn. ``cos_cache``/``sin_cache`` are float32 [max_position, rotary/2];
    a position outside them gives NaN rows, never a read outside the table."""
    assert q.dim() == k.dim() == 2 and q.shape[0] == k.shape[0] == positions.shape[0]
    assert q.shape[1] % head_dim == 0 and k.shape[1] % head_dim == 0
    assert cos_cache.stride() == sin_cache.stride() and cos_cache.stride(1) == 1
    num_tokens = q.shape[0]
    half = cos_cache.shape[1]
    assert 2 * half <= head_dim
    if num_tokens == 0 or half == 0:
        return
    hq, hk = q.shape[1] // head_dim, k.shape[1] // head_dim
    half_pad, qh_pad = triton.next_power_of_2(half), triton.next_power_of_2(hq)
    _rotary_kernel[(num_tokens,)](
        q, k, positions.contiguous(), cos_cache, sin_cache,
        q.stride(0), k.stride(0), cos_cache.stride(0),
        hq, hk, cos_cache.shape[0],
        HEAD_DIM=head_dim, HALF=half, HALF_PAD=half_pad,
        QH_PAD=qh_pad, KH_PAD=triton.next_power_of_2(hk), DT=_DT[q.dtype],
        num_warps=8 if qh_pad * half_pad > 4096 else 4,
    )  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]``, as a new tensor ``[..., d]``."""
    d = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        grid = (x2.shape[0], triton.cdiv(d, _SILU_BLOCK))
        _silu_and_mul_kernel[grid](x2, out, x2.stride(0), out.stride(0), d,
                                   DT=_DT[x.dtype], BLOCK=_SILU_BLOCK)
    return out.view(*x.shape[:-1], d)
