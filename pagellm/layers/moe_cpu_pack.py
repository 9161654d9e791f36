"""FusedMoE's experts in the fused CPU kernel's layouts (kernels/cpu_moe.py), float or int8.

After loading (and quantizing), ``CpuPackedExperts.pack`` moves a FusedMoE's stacks into the
kernel's layouts, one stack at a time, and drops the loaders' tensors:
- float experts: ``w13_weight``/``w2_weight`` -> ``w13_packed``/``w2_packed`` (the model dtype);
- weight-only int8 / int4 experts of the "cpu" backend (moe_quant.py): ``w13_qweight``/
  ``w2_qweight`` -> ``w13_packed``/``w2_packed`` (int8 codes in the order the activations' dtype
  reads; int4 codes two per byte), their scales (``*_scales``; int4 ``*_scales_and_zeros``)
  staying as the method keeps them: bfloat16, which the kernel reads as they are.
``unpack`` gives the module back exactly what it had before (``LLM.load_weights`` fills those,
then the module packs again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagellm.kernels import cpu_moe
from pagellm.kernels.cpu_build import kernels_enabled

STACKS = ("w13", "w2")


def _set(module: nn.Module, name: str, t: torch.Tensor) -> None:
    module.register_parameter(name, nn.Parameter(t, requires_grad=False))


def _int4_codes(moe: nn.Module, stack: str) -> torch.Tensor:
    """uint8 codes ``[E, N, K]`` of an int4 stack (the CPU method's packing read back)."""
    method = moe.quant.methods[stack]
    n = method.out_features
    return torch.stack([method.codes_t(moe.quant.expert_view(moe, stack, e))[:, :n].t()
                        for e in range(moe.num_experts)])


def _int4_qweight(codes: torch.Tensor) -> torch.Tensor:
    """The CPU int4 method's ``qweight`` stack for uint8 codes ``[E, N, K]``."""
    return torch.stack([torch._convert_weight_to_int4pack_for_cpu(c.to(torch.int32), 1)
                        for c in codes])


@dataclass(frozen=True, slots=True)
class CpuPackedExperts:
    kind: str  # "float" | "int8" | "int4"
    act_dtype: torch.dtype  # the activations the kernel takes (the model dtype)

    @staticmethod
    @torch.no_grad()
    def pack(moe: nn.Module) -> CpuPackedExperts | None:
        """Pack ``moe``'s experts where the kernel takes them; None (nothing changed) where not:
        kernels off or unavailable, not on the CPU, a shape or dtype it lacks, another
        quantization backend."""
        h, i = moe.hidden_size, moe.inter_per_rank
        if not kernels_enabled():
            return None
        if moe.quant is None:
            w13, w2 = moe.w13_weight.data, moe.w2_weight.data
            if w13.device.type != "cpu" or not cpu_moe.supports(w13.dtype, h, i):
                return None
            p13, p2 = cpu_moe.pack_experts(w13, w2)
            del moe.w13_weight, moe.w2_weight
            packed = CpuPackedExperts("float", w13.dtype)
        else:
            kind, act = moe.quant.config.method, moe.quant.methods["w13"].dtype
            scales = "scales" if kind == "int8" else "scales_and_zeros"
            if (moe.quant.backend != "cpu" or not cpu_moe.supports(act, h, i)
                    or any(getattr(moe, f"{s}_{scales}").dtype != torch.bfloat16
                           for s in STACKS)):
                return None
            if kind == "int8":
                p13, p2 = cpu_moe.pack_experts(moe.w13_qweight.data, moe.w2_qweight.data, act)
            else:
                p13, p2 = cpu_moe.pack_int4_experts(_int4_codes(moe, "w13"),
                                                    _int4_codes(moe, "w2"))
            del moe.w13_qweight, moe.w2_qweight
            packed = CpuPackedExperts(kind, act)
        _set(moe, "w13_packed", p13)
        _set(moe, "w2_packed", p2)
        return packed

    @torch.no_grad()
    def unpack(self, moe: nn.Module) -> None:
        """The module's tensors as ``pack`` found them (float stacks with their loader, or the
        quantized method's stacked parameters)."""
        h, i = moe.hidden_size, moe.inter_per_rank
        p13, p2 = moe.w13_packed.data, moe.w2_packed.data
        if self.kind == "int4":
            codes13, codes2 = cpu_moe.unpack_int4_experts(p13, p2, h, i)
            w13, w2 = _int4_qweight(codes13), _int4_qweight(codes2)
        else:
            w13, w2 = cpu_moe.unpack_experts(p13, p2, h, i, self.act_dtype)
        del moe.w13_packed, moe.w2_packed
        if self.kind == "float":
            for name, w in (("w13_weight", w13), ("w2_weight", w2)):
                _set(moe, name, w)
                getattr(moe, name).weight_loader = moe.weight_loader
            return
        _set(moe, "w13_qweight", w13)
        _set(moe, "w2_qweight", w2)

    def forward(self, moe: nn.Module, x: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.act_dtype:
            raise TypeError(f"MoE activations are {x.dtype}, but the experts were packed for "
                            f"{self.act_dtype}")
        p13, p2, i = moe.w13_packed, moe.w2_packed, moe.inter_per_rank
        if self.kind == "float":
            return cpu_moe.moe_forward(x, weights, ids, p13, p2, i)
        if self.kind == "int8":
            return cpu_moe.moe_forward(x, weights, ids, p13, p2, i, moe.w13_scales,
                                       moe.w2_scales)
        return cpu_moe.moe_forward(x, weights, ids, p13, p2, i, moe.w13_scales_and_zeros,
                                   moe.w2_scales_and_zeros, moe.quant.group_size)
