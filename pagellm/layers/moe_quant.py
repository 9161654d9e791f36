"""Weight-only INT8 / INT4 experts: FusedMoE's stacked weights quantized expert by expert.

Each expert's ``w13 [2I, H]`` and ``w2 [H, I]`` is quantized by the same method a linear layer of
that shape gets (quant_methods.py, on the backend ``quantization.resolve_backend`` picks), and
the method's parameters are stacked over experts on the FusedMoE module: ``w13_qweight
[E, ...]``, ``w13_scales [E, ...]``, and so on (``w13_weight``/``w2_weight`` are then gone).
- CPU ("cpu" backend): one expert at a time through the linear method's own kernels
  (``torch._weight_int8pack_mm`` / ``torch._weight_int4pack_mm_for_cpu``, or dequantize +
  bf16 matmul for many rows), on a view of that expert's slice of the stacks.
- CUDA ("triton" backend): the plain layout, which the grouped Triton kernel (triton_moe.py)
  dequantizes inside its K loop; "torch" (CUDA without triton) dequantizes per expert.

An int4 group divides both ``H`` and ``I`` (one group size for the layer), else the experts stay
float. ``LLM.load_weights`` gives the module float stacks back (``to_float_layout``) and then
re-quantizes only the experts it loaded into, in place (``quantize_experts``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn

from pagellm.layers.method_factory import make_linear_method
from pagellm.layers.quant_methods import QuantizedLinearMethod
from pagellm.layers.quantization import QuantConfig, choose_group_size

STACKS = ("w13", "w2")


def experts_group_size(config: QuantConfig, hidden_size: int, inter_per_rank: int) -> int | None:
    """The int4 group for both of an expert's weights (0 for int8); None when none fits."""
    if config.method != "int4":
        return 0
    return choose_group_size(math.gcd(hidden_size, inter_per_rank), config.group_size)


class ExpertsQuantMethod:
    """The quantized method of one FusedMoE's two stacks (one linear method per stack, shared by
    every expert: their state is per shape, not per expert)."""

    def __init__(self, config: QuantConfig, backend: str, moe: nn.Module) -> None:
        self.config = config
        self.methods: dict[str, QuantizedLinearMethod] = {}
        for stack in STACKS:
            method = make_linear_method(config, getattr(moe, f"{stack}_weight").data[0], backend)
            assert isinstance(method, QuantizedLinearMethod), "group chosen to fit both"
            self.methods[stack] = method
        self.backend = backend
        self.param_names: dict[str, tuple[str, ...]] = {}

    @property
    def group_size(self) -> int:
        return self.config.group_size if self.config.method == "int4" else 0

    def expert_view(self, moe: nn.Module, stack: str, expert: int) -> SimpleNamespace:
        """Expert ``expert``'s slice of every stacked parameter, named as the linear method
        names them on a layer (``qweight``, ``scales``, ...)."""
        return SimpleNamespace(**{p: getattr(moe, f"{stack}_{p}")[expert]
                                  for p in self.param_names[stack]})

    def matmul(self, moe: nn.Module, stack: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_expert^T`` in ``x.dtype``."""
        return self.methods[stack].apply(self.expert_view(moe, stack, expert), x, None)

    def dequantize(self, moe: nn.Module, stack: str, expert: int) -> torch.Tensor:
        """float32 ``[N, K]``: the weight ``matmul`` multiplies by."""
        return self.methods[stack].dequantize(self.expert_view(moe, stack, expert))

    @torch.no_grad()
    def quantize_experts(self, moe: nn.Module, experts: set[int] | None = None) -> None:
        """Quantize the float stacks' ``experts`` (all when None, creating the stacked
        parameters) into the stacked parameters, in place; then drop the float stacks."""
        for stack in STACKS:
            method = self.methods[stack]
            float_weight = getattr(moe, f"{stack}_weight").data
            todo = range(moe.num_experts) if experts is None else sorted(experts)
            # CPU int4 checks the op's packing on every weight: trust it only if all agree.
            layout_known = experts is None or getattr(method, "layout_known", True)
            for e in todo:
                holder = nn.Module()
                method.quantize_weights(holder, float_weight[e])
                layout_known = layout_known and getattr(method, "layout_known", True)
                params = dict(holder.named_parameters())
                if experts is None and e == 0:
                    self.param_names[stack] = tuple(params)
                    for p, t in params.items():
                        stacked = torch.empty(moe.num_experts, *t.shape, dtype=t.dtype,
                                              device=t.device)
                        moe.register_parameter(f"{stack}_{p}",
                                               nn.Parameter(stacked, requires_grad=False))
                for p, t in params.items():
                    getattr(moe, f"{stack}_{p}").data[e].copy_(t)
            if hasattr(method, "layout_known"):
                method.layout_known = layout_known
            delattr(moe, f"{stack}_weight")

    @torch.no_grad()
    def to_float_layout(self, moe: nn.Module) -> None:
        """Give ``moe`` its float ``w13_weight``/``w2_weight`` back (the dequantized experts, in
        the model dtype) for the loaders to fill; the quantized stacks stay until
        ``quantize_experts`` overwrites the experts that changed."""
        for stack in STACKS:
            method = self.methods[stack]
            qweight = getattr(moe, f"{stack}_qweight")
            # One expert's float32 temporary at a time, not the whole stack's.
            weight = torch.empty(moe.num_experts, method.out_features, method.in_features,
                                 dtype=method.dtype, device=qweight.device)
            for e in range(moe.num_experts):
                weight[e].copy_(self.dequantize(moe, stack, e))
            param = nn.Parameter(weight, requires_grad=False)
            param.weight_loader = moe.weight_loader  # type: ignore[attr-defined]
            moe.register_parameter(f"{stack}_weight", param)
