"""Row-wise argmax: the greedy token, and the pick of exponential-noise sampling."""

from __future__ import annotations

import torch

from pagellm.kernels import cpu_ops


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``[B, V]`` (first maximum; NaN counts as the maximum). On CPU one
    vectorized pass (C++ kernel), far faster than torch's CPU argmax over a large vocabulary
    (docs/performance-history-intel-amx.md has the figures)."""
    if x.dim() == 2 and cpu_ops.supports(x):
        return cpu_ops.argmax_rows(x)
    return x.argmax(dim=-1)
