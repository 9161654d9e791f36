"""Triton grouped GEMM for the Mixture-of-Experts layer on CUDA (vLLM's fused_moe approach).

The (token, k) assignments are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M`` (``moe_align_block_size``), so every ``BLOCK_M`` rows of the sorted list belong to one
expert. One launch then computes gate/up for all experts (a program reads its block's expert id
and gathers its tokens' rows of ``x``), SiLU-and-mul runs on the result, a second launch computes
down for all experts and scales each row by its routing weight, and the top-k rows of a token are
summed. Everything stays on the device with static shapes (no host read of the per-expert
counts), so a CUDA graph can capture it.

Expert weights are float (``w13 [E, 2I, H]``, ``w2 [E, H, I]``) or weight-only quantized in the
plain layout of quant_methods.TorchDequantMethod, stacked over experts and dequantized tile by
tile inside the K loop (as triton_quant.py does for a linear layer):
- int8: ``qweight`` int8 ``[E, N, K]``, ``scales [E, N]``; W = q * scale.
- int4: ``qweight`` uint8 ``[E, N, K // 2]`` (even k in the low nibble), ``scales``/``mins``
  ``[E, N, K // group]``; W = q * scale + min. ``BLOCK_K`` divides the group.

Triton is imported at module load: fused_moe.py imports this module only for the Triton path.
On CPU tensors the kernel runs under ``TRITON_INTERPRET=1`` (tests). Block sizes are fixed
heuristics, not autotuned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagellm.config import read_env
from pagellm.layers.triton_ops import _DT, _round, silu_and_mul

# Read once, like triton.jit, which picks the interpreter when it decorates the kernel below.
_INTERPRETING = read_env().triton_interpret
_QUANT_CODES = {None: 0, "int8": 1, "int4": 2}


@dataclass(frozen=True, slots=True)
class ExpertWeight:
    """One stacked expert weight (``w13`` or ``w2``) as the kernel reads it: float ``weight``
    ``[E, N, K]``, or ``qweight`` with ``scales`` (and ``mins`` for int4)."""

    weight: torch.Tensor  # float weight, or the quantized codes
    quant: str | None = None  # None | "int8" | "int4"
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    group_size: int = 0

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]


def supports(x: torch.Tensor) -> bool:
    return x.dtype in _DT and x.dim() == 2 and x.stride(1) == 1


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the flat (token, k) assignments by expert, each expert's run padded to ``block_m``.

    Returns ``sorted_ids`` (int32, the flat index ``t * top_k + j`` of each row, ``T * top_k``
    in padding rows), ``expert_ids`` (int32, the expert of each block of ``block_m`` rows) and
    ``num_rows`` (int32 ``[1]``: the padded rows in use). The first two are sized for the worst
    case, so the shapes depend on ``T`` only; blocks past ``num_rows`` are skipped by the kernel.
    Within an expert the assignments keep their flat order (a stable sort).
    """
    flat = topk_ids.reshape(-1).long()
    num_valid = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    run_starts = torch.cumsum(counts, 0) - counts  # where each expert's run begins, unpadded
    rank = torch.arange(num_valid, device=device) - run_starts[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    # At most min(E, T*k) experts get rows, each padding fewer than block_m.
    max_rows = triton.cdiv(num_valid + min(num_experts, num_valid) * (block_m - 1),
                           block_m) * block_m
    sorted_ids = torch.full((max_rows,), num_valid, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, m_ptr, out_ptr, topw_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_rows_ptr,
    N, K, num_valid,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_om,
    A_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
    UPCAST: tl.constexpr, DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = ids < num_valid
    a_rows = (ids // A_DIV).to(tl.int64)  # first GEMM: the token's row of x; second: the row
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + expert * stride_we + rn[None, :].to(tl.int64) * stride_wn
    s_rows = s_ptr + expert * stride_se + rn.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_mask = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        if QUANT == 2:
            byte = tl.load(w_rows + (k // 2)[:, None], mask=w_mask, other=0)
            q = (byte.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF
            g = k0 // GROUP
            s = tl.load(s_rows + g, mask=n_mask, other=0.0).to(tl.float32)
            mn = tl.load(m_ptr + expert * stride_se + rn.to(tl.int64) * stride_sn + g,
                         mask=n_mask, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * s[None, :] + mn[None, :]
        else:
            w = tl.load(w_rows + k[:, None], mask=w_mask, other=0)
            if QUANT == 1:
                w = w.to(tl.float32)
        if UPCAST:  # fp32 activations, or the interpreter (it multiplies bf16 tiles as raw bits)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if QUANT == 1:  # per-channel scales factor out of the K loop
        acc = acc * tl.load(s_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc = _round(acc, DT)  # the projection's output, in the activation dtype
    if MUL_WEIGHT:
        topw = tl.load(topw_ptr + ids, mask=row_mask, other=0.0).to(tl.float32)
        acc = _round(acc * topw[:, None], DT)
    tl.store(out_ptr + ids[:, None].to(tl.int64) * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _block_m(num_valid: int, num_experts: int) -> int:
    """16 rows per block while experts average at most 16 rows (decode), else 64: less padding
    for few tokens, better reuse of each weight tile for many."""
    return 16 if num_valid <= 16 * num_experts else 64


def _gemm(a: torch.Tensor, w: ExpertWeight, out: torch.Tensor, sorted_ids: torch.Tensor,
          expert_ids: torch.Tensor, num_rows: torch.Tensor, num_valid: int, a_div: int,
          block_m: int, topk_weights: torch.Tensor | None = None) -> None:
    n, k = w.out_features, a.shape[1]
    quant = _QUANT_CODES[w.quant]
    if quant == 2:
        assert w.weight.shape[2] * 2 == k and k % w.group_size == 0 and w.group_size % 32 == 0
        assert w.scales is not None and w.mins is not None
        assert w.scales.stride() == w.mins.stride()
        block_k = 32
    else:
        assert w.weight.shape[2] == k and w.weight.stride(2) == 1
        block_k = 32 if k <= 32 else 64
    scales = w.scales if w.scales is not None else w.weight
    grid = (expert_ids.shape[0], triton.cdiv(n, 64))
    _moe_gemm_kernel[grid](
        a, w.weight, scales, w.mins if w.mins is not None else scales, out,
        topk_weights if topk_weights is not None else a,
        sorted_ids, expert_ids, num_rows,
        n, k, num_valid,
        a.stride(0), w.weight.stride(0), w.weight.stride(1),
        scales.stride(0) if w.scales is not None else 0,
        scales.stride(1) if w.scales is not None else 0, out.stride(0),
        A_DIV=a_div, MUL_WEIGHT=topk_weights is not None, QUANT=quant,
        GROUP=max(w.group_size, 1), UPCAST=_INTERPRETING or a.dtype == torch.float32,
        DT=_DT[a.dtype], BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
    )  # fmt: skip


def fused_experts(x: torch.Tensor, w13: ExpertWeight, w2: ExpertWeight,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` through the routed experts: ``sum_j weight[t, j] * expert_{ids[t, j]}(x[t])``
    with ``expert(x) = down(silu(gate(x)) * up(x))``; ``[T, H]`` in ``x.dtype``."""
    assert supports(x) and topk_weights.shape == topk_ids.shape
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.weight.shape[0]
    hidden = w2.out_features
    if num_tokens == 0:
        return torch.empty(0, hidden, dtype=x.dtype, device=x.device)
    num_valid = num_tokens * top_k
    block_m = _block_m(num_valid, num_experts)
    sorted_ids, expert_ids, num_rows = moe_align_block_size(topk_ids, num_experts, block_m)
    gate_up = torch.empty(num_valid, w13.out_features, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, sorted_ids, expert_ids, num_rows, num_valid, top_k, block_m)
    act = silu_and_mul(gate_up)
    down = torch.empty(num_valid, hidden, dtype=x.dtype, device=x.device)
    _gemm(act, w2, down, sorted_ids, expert_ids, num_rows, num_valid, 1, block_m,
          topk_weights.reshape(-1).contiguous())
    # float32 sum over the top-k rows, rounded once.
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
