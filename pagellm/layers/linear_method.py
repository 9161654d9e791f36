"""How a linear layer stores its weight and computes ``x @ W^T + bias`` (vLLM's LinearMethodBase).

Each linear layer (and the LM head) holds one method, made by ``method_factory``. The layer
shards and loads; the method owns the weight's layout and the math:
- ``create_weights`` registers the parameters the checkpoint loads into,
- ``process_weights_after_loading`` turns them, once loaded, into the layout ``apply`` reads
  (CPU: the kernel chosen for the weight; quantized methods: the quantized weight),
- ``apply`` multiplies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.cpu_matmul import CpuMatmul, MatmulFn, choose_cpu_matmul

WeightLoader = Callable[..., None]


class LinearMethodBase:
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
        """A float ``weight [output_size, input_size]``: what every checkpoint pagellm reads
        holds (quantized methods quantize it after loading)."""
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype),
                              requires_grad=False)
        weight.weight_loader = weight_loader
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> bool:
        """Once, after loading; returns whether anything changed."""
        return False

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """The float weight; on CPU, after loading, the kernel chosen for it (kernels/cpu_matmul.py).

    With ``weight_shared`` (an LM head, whose weight a tied embedding also reads) the kernel's
    layout is a copy and ``layer.weight`` stays; otherwise it replaces ``layer.weight``.
    """

    def __init__(self, weight_shared: bool = False) -> None:
        self.weight_shared = weight_shared
        self.cpu: CpuMatmul | None = None
        self._matmul: MatmulFn = F.linear  # self.cpu.matmul once chosen
        self._cpu_weight: torch.Tensor | None = None  # weight_shared: the copy the kernel reads

    @property
    def cpu_kind(self) -> str | None:
        """The CPU kernel serving the weight: "amx", "packed", "onednn", or None (F.linear)."""
        return None if self.cpu is None else self.cpu.kind

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> bool:
        if self.cpu is not None:
            return False
        w = layer.weight.data
        self.cpu = choose_cpu_matmul(w, layer.bias)
        if self.cpu is None:
            return False
        self._matmul = self.cpu.matmul
        packed = self.cpu.pack(w)
        if packed is not w:
            if self.weight_shared:
                self._cpu_weight = packed
            else:
                layer.weight = nn.Parameter(packed, requires_grad=False)
        return True

    def kernel_weight(self, layer: nn.Module) -> torch.Tensor | None:
        """The weight a CPU kernel streams ("packed" or "amx"), which may move
        (``move_kernel_weight``); None for other kernels and for a weight an embedding reads."""
        if self.cpu_kind not in ("packed", "amx"):
            return None
        if self._cpu_weight is not None:
            return self._cpu_weight
        return None if self.weight_shared else layer.weight.data

    def move_kernel_weight(self, layer: nn.Module, dst: torch.Tensor) -> None:
        """Copy ``kernel_weight`` into ``dst`` (same shape and dtype), which the kernel then reads;
        the old tensor is dropped."""
        dst.copy_(self.kernel_weight(layer))
        if self._cpu_weight is not None:
            self._cpu_weight = dst
        else:
            layer.weight = nn.Parameter(dst, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer.weight if self._cpu_weight is None else self._cpu_weight
        return self._matmul(x, weight, bias)
