"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import cpu_ops


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2d]`` (the merged gate/up projection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.supports(x):
            return cpu_ops.silu_and_mul(x)  # one pass, no gate/up temporaries
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
