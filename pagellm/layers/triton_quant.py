"""Triton dequantize-matmul for weight-only INT8 / INT4 linears (the CUDA path).

``y[M, N] = x[M, K] @ W[N, K]^T`` where W is dequantized tile by tile inside the K loop, so the
weight crosses memory once, quantized. Storage (see quantization.py, "plain" layout):
- int8: ``qweight`` int8 ``[N, K]``, ``scales`` ``[N]``; W = q * scale (applied after the loop,
  since the scale is constant along K).
- int4: ``qweight`` uint8 ``[N, K // 2]`` (even k in the low nibble), ``scales`` and ``mins``
  ``[N, K // group]``; W = q * scale + min. ``BLOCK_K`` divides the group size, so every K tile
  reads one scale/min per output column.

Triton is imported at module load: only quant_methods.py imports this module, and only when the
triton path is chosen. On CPU tensors the kernel runs under ``TRITON_INTERPRET=1`` (tests).
Block sizes are fixed heuristics, not autotuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.config import read_env

# Read once, like triton.jit, which picks the interpreter when it decorates the kernel below.
_INTERPRETING = read_env().triton_interpret


@triton.jit
def _wq_matmul_kernel(
    x_ptr, qw_ptr, s_ptr, m_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sn, stride_ym,
    INT4: tl.constexpr, GROUP: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if INT4:
            byte = tl.load(qw_ptr + rn[None, :].to(tl.int64) * stride_qn + (k // 2)[:, None],
                           mask=w_mask, other=0)
            q = (byte.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
            g = k0 // GROUP
            s = tl.load(s_ptr + rn.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0)
            mn = tl.load(m_ptr + rn.to(tl.int64) * stride_sn + g, mask=n_mask, other=0.0)
            w = q.to(tl.float32) * s.to(tl.float32)[None, :] + mn.to(tl.float32)[None, :]
        else:
            w = tl.load(qw_ptr + rn[None, :].to(tl.int64) * stride_qn + k[:, None],
                        mask=w_mask, other=0).to(tl.float32)
        if UPCAST:  # fp32 activations, or the interpreter (it multiplies bf16 tiles as raw bits)
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")  # ieee: no tf32
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if not INT4:
        s = tl.load(s_ptr + rn, mask=n_mask, other=0.0)
        acc = acc * s.to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], y,
             mask=m_mask[:, None] & n_mask[None, :])


def wq_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor | None = None, group_size: int = 0) -> torch.Tensor:
    """``x [M, K] @ dequant(qweight)^T -> [M, N]`` in ``x.dtype`` (int4 when ``mins`` is given)."""
    assert x.dim() == 2 and x.stride(1) == 1
    int4 = mins is not None
    m, k = x.shape
    n = qweight.shape[0]
    if int4:
        assert qweight.shape[1] * 2 == k and k % group_size == 0 and group_size % 32 == 0
        assert scales.shape == mins.shape == (n, k // group_size)
        assert scales.stride() == mins.stride()
        block_k = 32
    else:
        assert qweight.shape[1] == k and scales.shape == (n,)
        block_k = 64
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64  # tl.dot needs >= 16 rows; decode batches are small
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wq_matmul_kernel[grid](
        x, qweight, scales, mins if int4 else scales, y,
        m, n, k,
        x.stride(0), qweight.stride(0), scales.stride(0) if int4 else 1, y.stride(0),
        INT4=int4, GROUP=max(group_size, 1), UPCAST=_INTERPRETING or x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y
