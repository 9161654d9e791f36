"""Where the layers' fused small ops come from: the C++ kernels on CPU (``pagellm.kernels.
cpu_ops``), Triton on CUDA (``pagellm.layers.triton_ops``, imported on first CUDA use so that
``import pagellm`` works without triton)."""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def triton_ops() -> ModuleType | None:
    """pagellm.layers.triton_ops, or None where triton is missing."""
    try:
        from pagellm.layers import triton_ops as ops
    except ImportError:
        return None
    return ops
