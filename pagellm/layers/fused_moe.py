"""Mixture-of-Experts MLP: a replicated router and every expert's weights stacked in two tensors.

``FusedMoE`` holds ``w13_weight [E, 2*I/tp, H]`` (each expert's gate rows, then its up rows) and
``w2_weight [E, H, I/tp]``. Tensor parallelism splits every expert along its intermediate
dimension, as vLLM's FusedMoE does without expert parallelism: each rank computes a partial down
projection for all experts and the partial sums are all-reduced, like a RowParallelLinear.

The forward routes as transformers does (softmax in float32, top-k, optional renormalization,
cast to the activations' dtype), then groups the (token, k) assignments by expert: one gather,
one pair of matmuls per expert that got tokens, one ``index_add_`` back. Adding the experts'
outputs in ascending expert order per token is transformers' order, so float32 results agree
to the bit on CPU.

That torch path is the reference, and the CPU path where the kernels cannot serve the experts.
Where they can (float32 or bfloat16 models, float or int8 experts, widths divisible by 16,
AVX-512), the experts are packed once after loading (``prepack_experts_for_cpu``,
moe_cpu_pack.py) and the whole MLP is one call of the fused kernel (kernels/cpu_moe.cpp: sort
by expert, gate/up with the SiLU on the tile, down rows scaled and added straight into the
output, a token's experts in ascending order). On CUDA (with triton) the experts run as two
grouped Triton GEMMs over all experts (triton_moe.py), which need no host-side counts, so CUDA
graphs capture them too. Where neither applies while a CUDA graph is being captured (no triton),
each expert runs over every token, weighted by its routing weight (zero where it was not chosen).

``--quantization int8|int4`` quantizes the experts too (``quantize_``, moe_quant.py): on CPU int8
through the fused kernel, int4 per expert through the linear layers' quantized kernels; on CUDA
dequantized inside the grouped Triton kernel. The router stays float.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed.communication import tensor_model_parallel_all_reduce
from pagellm.distributed.parallel_state import get_tp_rank, get_tp_size
from pagellm.layers.moe_cpu_pack import CpuPackedExperts
from pagellm.layers.moe_quant import ExpertsQuantMethod, experts_group_size
from pagellm.layers.quantization import QuantConfig, resolve_backend

# Expert shard names: w1 = gate, w3 = up (both [I, H]), w2 = down ([H, I]), Mixtral's names.
EXPERT_SHARDS = ("w1", "w3", "w2")


@functools.cache
def triton_moe() -> ModuleType | None:
    """pagellm.layers.triton_moe, or None where triton is missing (imported on first use)."""
    try:
        from pagellm.layers import triton_moe as ops
    except ImportError:
        return None
    return ops


class MoeRouter(nn.Module):
    """``[T, H] -> [T, E]`` router logits; replicated, and kept out of the linear methods so
    quantization and CPU prepacking never change which experts a token picks."""

    def __init__(self, hidden_size: int, num_experts: int,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if loaded.shape != param.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit "
                             f"router weight {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` in ``dtype``, expert ids ``[T, k]``), as transformers routes."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"the experts' intermediate size ({intermediate_size}) is not "
                             f"divisible by tensor_parallel_size ({self.tp_size})")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in 1..{num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # the whole, unsharded width
        self.inter_per_rank = intermediate_size // self.tp_size
        dtype = params_dtype or torch.get_default_dtype()
        i, h = self.inter_per_rank, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, h, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, h, i, dtype=dtype),
                                      requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.quant: ExpertsQuantMethod | None = None  # set by quantize_
        # The stacks in the fused CPU kernel's layouts (prepack_for_cpu), or None.
        self.cpu: CpuPackedExperts | None = None
        self._repack = False  # unpacked for a weight update: pack again after it
        self._loaded_experts: set[int] = set()  # experts loaded since the last quantization

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str]) -> None:
        """One expert's whole checkpoint tensor (``shard_id = (expert, "w1"|"w3"|"w2")``) ->
        this rank's slice of its intermediate dimension."""
        expert, which = shard_id
        if not 0 <= expert < self.num_experts or which not in EXPERT_SHARDS:
            raise ValueError(f"no expert shard {shard_id!r} (experts 0..{self.num_experts - 1}, "
                             f"shards {EXPERT_SHARDS})")
        full, i, h = self.intermediate_size, self.inter_per_rank, self.hidden_size
        dim = 1 if which == "w2" else 0  # the intermediate dimension of the checkpoint tensor
        expected = (h, full) if which == "w2" else (full, h)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} should be "
                             f"{expected} (the whole, unsharded {which} of one expert)")
        part = loaded.narrow(dim, self.tp_rank * i, i)
        if which == "w2":
            param.data[expert].copy_(part)
        else:
            param.data[expert, (0 if which == "w1" else i):][:i].copy_(part)
        self._loaded_experts.add(expert)

    @torch.no_grad()
    def quantize_(self, config: QuantConfig, backend: str = "auto") -> int | None:
        """After loading: quantize every expert (this rank's shard). Returns the int4 group
        size (0 for int8), or None when the experts stay float (no group divides both the
        hidden size and this rank's expert width)."""
        assert self.quant is None, "experts already quantized"
        group = experts_group_size(config, self.hidden_size, self.inter_per_rank)
        if group is None:
            return None
        backend = resolve_backend(backend, self.w13_weight.device)
        self.quant = ExpertsQuantMethod(QuantConfig(config.method, group), backend, self)
        self.quant.quantize_experts(self)
        self._loaded_experts.clear()
        return group

    @property
    def cpu_packed(self) -> bool:
        return self.cpu is not None

    def prepack_for_cpu(self) -> bool:
        """After loading (and quantizing): the experts into the fused CPU kernel's layouts
        where it takes them (moe_cpu_pack.py); returns whether they moved."""
        if self.cpu is None:
            self.cpu = CpuPackedExperts.pack(self)
        return self.cpu is not None

    def to_float_layout(self) -> None:
        """Float ``w13_weight``/``w2_weight`` again, for ``LLM.load_weights`` (packed experts
        unpacked, quantized ones dequantized; ``process_weights_after_loading`` re-quantizes
        the experts it loaded into and packs the stacks again)."""
        if self.cpu is not None:
            self.cpu.unpack(self)
            self.cpu, self._repack = None, True
            self._loaded_experts.clear()
        if self.quant is not None and not hasattr(self, "w13_weight"):
            self.quant.to_float_layout(self)
            self._loaded_experts.clear()

    def process_weights_after_loading(self) -> bool:
        changed = False
        if self.quant is not None and hasattr(self, "w13_weight"):
            self.quant.quantize_experts(self, set(self._loaded_experts))
            changed = True
        self._loaded_experts.clear()
        if self._repack:
            self._repack = False
            changed = self.prepack_for_cpu() or changed
        return changed

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        if self.quant is not None:
            gate, up = self.quant.matmul(self, "w13", e, x).chunk(2, dim=-1)
            return self.quant.matmul(self, "w2", e, F.silu(gate) * up)
        gate, up = F.linear(x, self.w13_weight[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2_weight[e])

    def _triton_ops(self, x: torch.Tensor) -> ModuleType | None:
        """triton_moe when this forward takes the grouped Triton kernels: CUDA activations with
        float or "triton"-backend experts (that backend also runs on CPU under
        TRITON_INTERPRET=1, the tests' way in)."""
        backend = None if self.quant is None else self.quant.backend
        if not (backend == "triton" or (x.is_cuda and backend is None)):
            return None
        ops = triton_moe()
        return ops if ops is not None and ops.supports(x) else None

    def _expert_weights(self, ops: ModuleType) -> tuple[object, object]:
        if self.quant is None:
            return ops.ExpertWeight(self.w13_weight), ops.ExpertWeight(self.w2_weight)
        method, group = self.quant.config.method, self.quant.group_size
        return tuple(ops.ExpertWeight(getattr(self, f"{s}_qweight"), method,
                                      getattr(self, f"{s}_scales"),
                                      getattr(self, f"{s}_mins", None), group)
                     for s in ("w13", "w2"))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``router_logits [T, E]`` -> ``[T, H]`` (all-reduced over tp)."""
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        if self.cpu is not None:
            out = self.cpu.forward(self, x, weights, ids)
        elif (ops := self._triton_ops(x)) is not None:
            out = ops.fused_experts(x, *self._expert_weights(ops), weights, ids)
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self._forward_dense(x, weights, ids)
        else:
            out = self._forward_grouped(x, weights, ids)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def _forward_grouped(self, x: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        # Stable: a token's assignments keep ascending expert order, transformers' sum order.
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, tokens)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start:start + n] = self._expert(rows[start:start + n], e)
                start += n
        out.mul_(weights.reshape(-1)[order].unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _forward_dense(self, x: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            out += self._expert(x, e) * dense[:, e:e + 1]
        return out


def prepack_experts_for_cpu(model: nn.Module) -> int:
    """After loading (and quantizing): every FusedMoE's float CPU experts into the fused
    kernel's layouts where it takes them; returns how many moved. ``PAGELLM_CPU_KERNELS=0``
    leaves them to the torch path."""
    return sum(m.prepack_for_cpu() for m in model.modules() if isinstance(m, FusedMoE))


class SparseMoeBlock(nn.Module):
    """Router + experts: the MLP of a MoE decoder layer (``gate`` and ``experts`` as the
    checkpoints name them)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.gate = MoeRouter(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
