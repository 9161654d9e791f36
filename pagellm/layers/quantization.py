"""Weight-only quantization of the linear layers (and MoE experts, moe_quant.py): INT8 per output
channel, INT4 per group.

Formats (``W`` is a linear weight ``[N, K]``, output by input features):
- int8: ``W[n, k] ~ q[n, k] * scale[n]``, ``q`` in [-127, 127] (symmetric, per output channel).
- int4: ``W[n, k] ~ q[n, k] * scale[n, g] + min[n, g]``, ``q`` in [0, 15], ``g = k // group``
  (asymmetric, min/max per group of ``group`` input weights: GGUF Q4_1's formula).

Rounding to nearest bounds the error of every weight by half a step: ``scale / 2``.

``quantize_model`` runs after the weights are loaded. Each rank quantizes its own shard, so the
scales are sharded with their weights under tensor parallelism (a row-parallel shard only needs
its K to be a multiple of the group). The kernels behind each layer are in quant_methods.py.
The layers (and config.py) import this module, so it imports none of them back:
``quantize_model`` finds the linears by their ``quantize_`` (``QuantizableLayer``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

logger = logging.getLogger("pagellm")

INT4_GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_INT4_GROUP_SIZE = 32  # best quality; GGUF Q4_0/Q4_1 blocks are 32 too
QUANTIZATION_CHOICES = ("none", "int8", "int4", *(f"int4-g{g}" for g in INT4_GROUP_SIZES))
QUANT_BACKENDS = ("auto", "cpu", "triton", "torch")


@dataclass(frozen=True, slots=True)
class QuantConfig:
    method: str  # "int8" | "int4"
    group_size: int = 0  # int4: input weights per scale/min (0 for int8)

    @property
    def name(self) -> str:
        return self.method if self.method == "int8" else f"int4-g{self.group_size}"


def parse_quantization(spec: str | QuantConfig | None) -> QuantConfig | None:
    """``--quantization``: none, int8, int4 (group 32) or int4-g{32,64,128,256}."""
    if spec is None or isinstance(spec, QuantConfig):
        return spec
    text = spec.strip().lower()
    if text in ("", "none"):
        return None
    if text == "int8":
        return QuantConfig("int8")
    if text == "int4":
        return QuantConfig("int4", DEFAULT_INT4_GROUP_SIZE)
    if text.startswith("int4-g") and text[6:].isdigit() and int(text[6:]) in INT4_GROUP_SIZES:
        return QuantConfig("int4", int(text[6:]))
    raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                     f"got {spec!r}.")


# ---- reference quantizers (float32 math, any device) ---------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (int8 ``q [N, K]``, float32 ``scales [N]``)."""
    w = w.float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero row
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scales.float()[:, None]).to(dtype)


def quantize_int4(w: torch.Tensor, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (uint8 codes ``[N, K]`` in 0..15, float32 ``scales``/``mins``
    ``[N, K // group_size]``)."""
    n, k = w.shape
    assert k % group_size == 0, (k, group_size)
    g = w.float().reshape(n, k // group_size, group_size)
    mins = g.amin(dim=-1)
    scales = (g.amax(dim=-1) - mins) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # constant group
    codes = torch.round((g - mins[..., None]) / scales[..., None]).clamp_(0, 15)
    return codes.to(torch.uint8).reshape(n, k), scales, mins


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = codes.shape
    group = k // scales.shape[1]
    g = codes.float().reshape(n, -1, group) * scales.float()[..., None] + mins.float()[..., None]
    return g.reshape(n, k).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[N, K]`` -> ``[N, K // 2]`` bytes, even k in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def choose_group_size(in_features: int, requested: int) -> int | None:
    """The largest supported group <= ``requested`` that divides ``in_features`` (None if none):
    e.g. K=576 (SmolLM2's hidden size) with group 128 falls back to 64."""
    for g in sorted(INT4_GROUP_SIZES, reverse=True):
        if g <= requested and in_features % g == 0:
            return g
    return None


# ---- applying it to a model ----------------------------------------------------------------
@runtime_checkable
class QuantizableLayer(Protocol):
    """A layer that can quantize its loaded weight (the linears: ``LinearBase.quantize_``)."""

    def quantize_(self, config: QuantConfig, backend: str = "auto") -> int | None: ...


@dataclass
class QuantReport:
    config: QuantConfig
    backend: str
    num_quantized: int = 0  # layers, MoE expert stacks included
    num_moe: int = 0  # MoE layers whose experts were quantized
    skipped: list[str] = field(default_factory=list)  # layers left in float (no usable group)
    group_sizes: Counter = field(default_factory=Counter)  # int4: group -> number of layers
    bytes_before: int = 0
    bytes_after: int = 0


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto": CPU -> PyTorch's weight-only CPU ops; CUDA -> triton (torch dequant without it)."""
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"quantization backend must be one of {', '.join(QUANT_BACKENDS)}, "
                         f"got {backend!r}")
    if backend != "auto":
        return backend
    if device.type == "cpu":
        return "cpu"
    try:
        import triton  # noqa: F401
    except ImportError:
        logger.warning("triton is not installed: quantized linears dequantize their weights "
                       "with torch ops on every call (slow)")
        return "torch"
    return "triton"


@torch.no_grad()
def quantize_model(model: nn.Module, spec: str | QuantConfig | None,
                   backend: str = "auto") -> QuantReport | None:
    """Quantize every linear layer and MoE expert stack (``FusedMoE.quantize_``) of a loaded
    ``model`` in place; None when ``spec`` is none.

    Embeddings, the LM head, norms, biases and MoE routers stay in the model dtype.
    """
    config = parse_quantization(spec)
    if config is None:
        return None
    device = next(model.parameters()).device
    report = QuantReport(config, resolve_backend(backend, device), bytes_before=param_bytes(model))
    for name, module in model.named_modules():
        if not isinstance(module, QuantizableLayer):
            continue
        group = module.quantize_(config, report.backend)
        if group is None:
            report.skipped.append(name)
            continue
        report.num_quantized += 1
        report.num_moe += hasattr(module, "num_experts")  # a FusedMoE (not imported here)
        if config.method == "int4":
            report.group_sizes[group] += 1
    report.bytes_after = param_bytes(model)
    groups = ", ".join(f"group {g}: {c}" for g, c in sorted(report.group_sizes.items()))
    moe = f" and {report.num_moe} MoE expert stacks" if report.num_moe else ""
    logger.info("Quantized %d linear layers%s to %s (%s kernels%s): weights %.1f MiB -> %.1f MiB",
                report.num_quantized - report.num_moe, moe, config.name, report.backend,
                f"; {groups}" if groups else "", report.bytes_before / 2**20,
                report.bytes_after / 2**20)
    if report.skipped:
        logger.warning("%d layers stay unquantized (no int4 group divides their input size): %s",
                       len(report.skipped), ", ".join(report.skipped[:4]))
    return report
