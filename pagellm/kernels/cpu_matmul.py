"""Which kernel multiplies by a loaded CPU weight (``x @ W^T + bias``), decided once per weight.

Kinds, by preference:
- "amx": ``cpu_ops.linear`` on the weight as it is (bfloat16 with AMX and the kernels built), for
  inputs up to ``AMX_LINEAR_MAX_ROWS`` rows; torch's matmul beyond, where oneDNN's per-call
  reorder of the plain weight costs little next to the product.
- "packed": ``cpu_ops.linear_packed`` on ``cpu_ops.linear_pack``'s copy (AVX-512,
  ``cpu_linear_vec.cpp``), for every row count. Not bit-identical to oneDNN in either dtype:
  another summation order.
- "onednn": torch's matmul on oneDNN's blocked layout, reordered once (bit-identical to
  ``F.linear`` in bfloat16; another summation order than MKL's in float32).
A packed or blocked weight is opaque to everything but its kernel: it can no longer be loaded
or quantized. ``PAGELLM_CPU_KERNELS=0`` leaves every weight to ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_ops
from pagellm.kernels.cpu_build import kernels_enabled

# Up to this many input rows bf16 weights AMX serves take its kernel, beyond it torch's oneDNN
# matmul on the plain weight: past it the kernel falls behind oneDNN, and steps up to this size
# also run as one fused call (llama_cpu_fused.py). Measurements: docs/attention.md.
AMX_LINEAR_MAX_ROWS = 1024

# Dtypes whose CPU weights get a kernel chosen at load.
CPU_PACKED_DTYPES = (torch.bfloat16, torch.float32)


def amx_max_numel(weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The largest input (elements) ``cpu_ops.linear`` takes for this weight: 0 where it
    cannot serve it (see ``cpu_ops.linear_supports``; a bias must be bfloat16 too)."""
    if cpu_ops.linear_supports(weight) and (bias is None or bias.dtype == torch.bfloat16):
        return AMX_LINEAR_MAX_ROWS * weight.shape[1]
    return 0


def cpu_matmul_kind(weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """"amx", "packed" or "onednn" (see the module's docstring), or None: left to ``F.linear``
    (other devices and dtypes, weights already packed, a bias of another dtype)."""
    if (weight.is_mkldnn or weight.device.type != "cpu"
            or weight.dtype not in CPU_PACKED_DTYPES):
        return None
    if amx_max_numel(weight, bias):
        return "amx"
    if bias is not None and bias.dtype != weight.dtype:
        return None
    if cpu_ops.linear_packed_supports(weight):
        return "packed"
    return "onednn" if onednn_supports(weight.dtype) else None


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN's blocked layout serves this dtype here: bfloat16 needs AVX-512 (BW, VL,
    DQ) or AVX-NE-CONVERT, so an AVX2-only CPU leaves bfloat16 weights to ``F.linear``."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


# (x, the weight as CpuMatmul.pack returned it, bias) -> x @ W^T + bias
MatmulFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _amx_matmul(max_numel: int) -> MatmulFn:
    def matmul(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        if 0 < x.numel() <= max_numel and x.dtype == torch.bfloat16:
            return cpu_ops.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    return matmul


def _onednn_matmul(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@dataclass(frozen=True, slots=True)
class CpuMatmul:
    """The kernel chosen for one weight: ``pack`` gives the weight in the layout ``matmul``
    reads (the "amx" kind reads the plain weight). The layers call ``matmul`` directly, so no
    choice is made again per call."""

    kind: str  # "amx" | "packed" | "onednn"
    matmul: MatmulFn

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        if self.kind == "packed":
            return cpu_ops.linear_pack(weight)
        if self.kind == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(weight)
        return weight


def choose_cpu_matmul(weight: torch.Tensor, bias: torch.Tensor | None) -> CpuMatmul | None:
    """The kernel for a loaded weight (and bias), or None: ``F.linear`` serves it."""
    if not kernels_enabled():
        return None
    kind = cpu_matmul_kind(weight, bias)
    if kind == "amx":
        return CpuMatmul(kind, _amx_matmul(amx_max_numel(weight, bias)))
    if kind == "packed":
        return CpuMatmul(kind, cpu_ops.linear_packed)
    if kind == "onednn":
        return CpuMatmul(kind, _onednn_matmul)
    return None
