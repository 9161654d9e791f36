"""RMSNorm with an optional fused residual add, computed like transformers (fp32 variance).

On CPU one C++ kernel does the add and the norm in a single pass; on CUDA a Triton kernel does
(triton_ops.py). Both keep the roundings of the torch path, which stays for other devices and
dtypes and where triton is missing."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import cpu_ops
from pagellm.layers.fused_ops import triton_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: None = None) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"norm weight shape {tuple(loaded.shape)} != {tuple(param.shape)}")
        param.data.copy_(loaded)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        if cpu_ops.supports(x, self.weight, *(() if residual is None else (residual,))):
            out, summed = cpu_ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, summed)
        if x.is_cuda and (ops := triton_ops()) is not None and ops.supports(
                x, self.weight, *(() if residual is None else (residual,))):
            out, summed = ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, summed)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch path (the reference of both kernels)."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores ``w`` and the scale is ``1 + w``, applied in float32
    before the cast back (transformers' Gemma2/3 order; Llama casts first). Plain torch ops."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.weight.weight_loader = RMSNorm.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
