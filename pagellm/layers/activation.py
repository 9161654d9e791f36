"""Gated activations (one C++ kernel on CPU, one Triton kernel on CUDA, else torch ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import cpu_ops
from pagellm.layers.fused_ops import triton_ops


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]`` (the merged gate/up projection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.supports(x):
            return cpu_ops.silu_and_mul(x)  # one pass, no gate/up temporaries
        if x.is_cuda and (ops := triton_ops()) is not None and ops.supports(x):
            return ops.silu_and_mul(x)
        return self.forward_native(x)

    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        """The torch path (the reference of both kernels)."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` (GeGLU with the tanh approximation: Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
