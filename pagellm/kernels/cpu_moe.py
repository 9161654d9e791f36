"""Tensor-level wrapper of the fused CPU MoE kernel (``cpu_moe.cpp``) and its weight layouts.

``pack_experts`` turns FusedMoE's stacks (``w13 [E, 2I, H]``: each expert's gate rows then its
up rows; ``w2 [E, H, I]``) into the layouts the kernel streams, on 2 MiB pages; ``unpack_experts``
gives the plain stacks back (``LLM.load_weights``). Both packed tensors hold exactly the plain
ones' elements, so packing at load costs no memory beyond one stack's copy while it is made.
The stacks may be float (of the activations' dtype) or weight-only int8 codes
(``quantization.quantize_int8``: per-output scales), packed in the order the activations' dtype
reads (``act_dtype``); or int4 codes (``pack_int4_experts``: two per byte, either activation
dtype), whose (scale, zero) pairs per group stay as the CPU int4 method keeps them.
"""

from __future__ import annotations

import torch

from pagellm.kernels import cpu_ops
from pagellm.kernels.huge_pages import empty_on_huge_pages

_OUT_OF_BOUNDS = -1


def _per(act_dtype: torch.dtype) -> int:
    """Input dims one vector lane holds: a bfloat16 pair, one float32."""
    return 2 if act_dtype == torch.bfloat16 else 1


def supports(dtype: torch.dtype, hidden: int, inter: int) -> bool:
    """Whether the kernel takes experts of this dtype, hidden size and (per-rank) width here:
    float32 or bfloat16, both sizes multiples of 16, AVX-512 (AVX512-BF16 for bfloat16)."""
    lib = cpu_ops.library()
    return (lib is not None and cpu_ops.dtype_supported(dtype)
            and bool(lib.pagellm_moe_available(cpu_ops.dtype_code(dtype), hidden, inter)))


def _gate_up_view(packed: torch.Tensor, inter: int, hidden: int, per: int) -> torch.Tensor:
    """The packed gate/up stack as ``[E, I/16 pairs, H/per steps, 2 (gate, up), 16, per]``."""
    return packed.view(-1, inter // 16, hidden // per, 2, 16, per)


def _down_view(packed: torch.Tensor, hidden: int, inter: int, per: int) -> torch.Tensor:
    """The packed down stack as ``[E, H/16 blocks, I/per steps, 16, per]``."""
    return packed.view(-1, hidden // 16, inter // per, 16, per)


@torch.no_grad()
def pack_experts(w13: torch.Tensor, w2: torch.Tensor, act_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate/up, down) in the kernel's layouts (``cpu_moe.cpp``'s header), flat ``[E, N]``, for
    activations of ``act_dtype`` (default: the stacks' own dtype)."""
    e, two_i, h = w13.shape
    i, per = two_i // 2, _per(act_dtype or w13.dtype)
    p13 = empty_on_huge_pages((e, two_i * h), w13.dtype)
    # [E, (gate|up) 2, I/16, 16, H/per, per] -> [E, I/16, H/per, 2, 16, per]
    src = w13.view(e, 2, i // 16, 16, h // per, per).permute(0, 2, 4, 1, 3, 5)
    _gate_up_view(p13, i, h, per).copy_(src)
    p2 = empty_on_huge_pages((e, h * i), w2.dtype)
    # [E, H/16, 16, I/per, per] -> [E, H/16, I/per, 16, per]
    _down_view(p2, h, i, per).copy_(w2.view(e, h // 16, 16, i // per, per).permute(0, 1, 3, 2, 4))
    return p13, p2


@torch.no_grad()
def pack_int4_experts(codes13: torch.Tensor, codes2: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes (0..15) ``[E, 2I, H]`` and ``[E, H, I]`` -> the kernel's int4 layouts
    (``Fmt<T, Int4>`` in cpu_moe.cpp): per step of two input dims, 16 bytes of a block's 16
    outputs, byte n = code(n, k) | code(n, k + 1) << 4; gate/up steps interleaved per pair."""
    e, two_i, h = codes13.shape
    i = two_i // 2
    c13 = codes13.view(e, 2, i // 16, 16, h // 2, 2).permute(0, 2, 4, 1, 3, 5)
    c2 = codes2.view(e, h // 16, 16, i // 2, 2).permute(0, 1, 3, 2, 4)
    out = []
    for c in (c13, c2):
        packed = empty_on_huge_pages((e, c[0].numel() // 2), torch.uint8)
        packed.view(c.shape[:-1]).copy_(c[..., 0] | (c[..., 1] << 4))
        out.append(packed)
    return out[0], out[1]


@torch.no_grad()
def unpack_int4_experts(p13: torch.Tensor, p2: torch.Tensor, hidden: int, inter: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_int4_experts``' inverse: uint8 codes ``[E, 2I, H]`` and ``[E, H, I]``."""
    e, h, i = p13.shape[0], hidden, inter
    b13 = p13.view(e, i // 16, h // 2, 2, 16)
    b2 = p2.view(e, h // 16, i // 2, 16)
    c13 = torch.stack([b13 & 15, b13 >> 4], dim=-1).permute(0, 3, 1, 4, 2, 5)
    c2 = torch.stack([b2 & 15, b2 >> 4], dim=-1).permute(0, 1, 3, 2, 4)
    return c13.reshape(e, 2 * i, h).contiguous(), c2.reshape(e, h, i).contiguous()


@torch.no_grad()
def unpack_experts(p13: torch.Tensor, p2: torch.Tensor, hidden: int, inter: int,
                   act_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_experts``' inverse: the plain ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``."""
    e, per = p13.shape[0], _per(act_dtype or p13.dtype)
    w13 = _gate_up_view(p13, inter, hidden, per).permute(0, 3, 1, 4, 2, 5)
    w2 = _down_view(p2, hidden, inter, per).permute(0, 1, 3, 2, 4)
    return (w13.reshape(e, 2 * inter, hidden).contiguous(),
            w2.reshape(e, hidden, inter).contiguous())


def moe_forward(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, p13: torch.Tensor,
                p2: torch.Tensor, inter: int, scales13: torch.Tensor | None = None,
                scales2: torch.Tensor | None = None, group: int = 0) -> torch.Tensor:
    """The MoE MLP of ``x [T, H]`` with routing ``weights``/``ids [T, k]`` over the packed
    experts (``supports`` checked first): ``[T, H]`` in x's dtype. The stacks' dtype says their
    format: x's dtype (``pack_experts``); int8 (``pack_experts`` of int8 codes) with bfloat16
    per-output scales ``scales13 [E, 2I]``, ``scales2 [E, H]``; uint8 (``pack_int4_experts``)
    with bfloat16 (scale, zero) pairs ``scales13 [E, H/group, 2I, 2]``, ``scales2
    [E, I/group, H, 2]``. The routing weights are used as they are, in float32 (pass them
    already rounded to x's dtype to multiply as transformers does)."""
    t, h = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty(t, h, dtype=x.dtype)
    e, top_k = p13.shape[0], ids.shape[1]
    lib, code = cpu_ops.library(), cpu_ops.dtype_code(x.dtype)
    head = (code, out.data_ptr(), h, x.data_ptr(), x.stride(0), ids.data_ptr(),
            weights.data_ptr(), p13.data_ptr(), p2.data_ptr())
    sizes = (t, top_k, e, h, inter)
    if p13.dtype in (torch.int8, torch.uint8):
        if scales13 is None or scales2 is None:
            raise ValueError("cpu_moe.moe_forward: quantized experts need their scales")
        int4 = p13.dtype == torch.uint8
        if int4 and (group <= 0 or h % group or inter % group):
            raise ValueError(f"cpu_moe.moe_forward: int4 group {group} does not divide "
                             f"{h} and {inter}")
        shapes = (((e, h // group, 2 * inter, 2), (e, inter // group, h, 2)) if int4
                  else ((e, 2 * inter), (e, h)))
        for name, sc, shape in zip(("scales13", "scales2"), (scales13, scales2), shapes,
                                   strict=True):
            _check(sc, shape, name)
        if int4:
            rc = lib.pagellm_moe_forward_int4(*head, scales13.data_ptr(), scales2.data_ptr(),
                                              group, *sizes)
        else:
            rc = lib.pagellm_moe_forward_int8(*head, scales13.data_ptr(), scales2.data_ptr(),
                                              *sizes)
    else:
        if p13.dtype != x.dtype:
            raise TypeError(f"cpu_moe.moe_forward: activations are {x.dtype}, experts "
                            f"{p13.dtype}")
        rc = lib.pagellm_moe_forward(*head, *sizes)
    if rc == _OUT_OF_BOUNDS:
        raise IndexError(f"cpu_moe.moe_forward: an expert id lies outside 0..{e - 1}")
    if rc != 1:
        raise RuntimeError("cpu_moe.moe_forward cannot take these experts here (check "
                           "cpu_moe.supports first)")
    return out


def _check(t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    # The kernel indexes by these: a mismatch must not reach it (not an assert: python -O).
    if tuple(t.shape) != shape or t.dtype != torch.bfloat16 or not t.is_contiguous():
        raise ValueError(f"cpu_moe.moe_forward: {what} must be contiguous bfloat16 {shape}, "
                         f"not {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}")
