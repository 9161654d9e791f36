"""How one quantized linear layer stores its weight and computes ``x @ W^T + bias``.

Pagellm quantizes float checkpoints online: a layer loads its float weight, then ``quantize_``
swaps in one of these methods (``method_factory.make_linear_method``), whose
``process_weights_after_loading`` replaces the weight by its quantized parameters.

Backends (chosen by ``quantization.resolve_backend``):
- "cpu": PyTorch's own weight-only CPU ops. int8: ``torch._weight_int8pack_mm`` (int8 weight,
  per-channel scales); int4: ``torch._weight_int4pack_mm_for_cpu`` on a weight packed by
  ``torch._convert_weight_to_int4pack_for_cpu`` (scales and zero points per group). They are
  GEMV-style kernels: fast for a few rows, but their cost grows with every row while a bf16
  matmul (oneDNN/AMX) barely does. Above ``*_KERNEL_MAX_ROWS`` rows (prefill, large decode
  batches) the weight is dequantized on the fly and multiplied by F.linear. Both ops are only
  fast with bf16 activations (their fp32 paths are far slower than an fp32 matmul; see
  docs/quantization.md), so an fp32 model computes its quantized linears in bf16.
- "triton": a dequantize-matmul kernel (triton_quant.py), the CUDA path.
- "torch": dequantize with torch ops on every call, then F.linear (CUDA without triton).

Parameters are registered as ``nn.Parameter(requires_grad=False)`` even when integer, so
``model.parameters()`` keeps counting every weight byte (the runner's weight_bytes, KV planning).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.linear_method import LinearMethodBase
from pagellm.layers.quantization import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

# Above this many rows the CPU ops lose to dequantize + bf16 matmul (benchmarks/quantization.py
# --sweep-rows measures the crossover; int4's dequantization costs more, so it switches later).
INT8_KERNEL_MAX_ROWS = 12
INT4_KERNEL_MAX_ROWS = 64
_DEQUANT_CHUNK = 2**17  # float32 elements dequantized at a time


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantizedLinearMethod(LinearMethodBase):
    """One layer's quantized weight. ``quantize_weights`` registers the quantized parameters on
    the layer (from its float weight); ``apply`` computes ``x @ W^T + bias`` for any leading
    shape of ``x``; ``dequantize`` returns, as float32 ``[N, K]``, the weight ``apply`` uses."""

    def __init__(self, method: str, out_features: int, in_features: int, group_size: int,
                 dtype: torch.dtype) -> None:
        self.method = method
        self.out_features = out_features
        self.in_features = in_features
        self.group_size = group_size  # 0 for int8
        self.dtype = dtype  # the model's (activations in and out)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> bool:
        if hasattr(layer, "qweight"):  # quantized already
            return False
        self.quantize_weights(layer, layer.weight.data)
        del layer.weight
        return True

    def quantize_weights(self, layer: nn.Module, weight: torch.Tensor) -> None:
        raise NotImplementedError

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.matmul(layer, x2).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)


class CpuInt8Method(QuantizedLinearMethod):
    def quantize_weights(self, layer: nn.Module, weight: torch.Tensor) -> None:
        self.compute_dtype = torch.bfloat16 if self.dtype == torch.float32 else self.dtype
        q, scales = quantize_int8(weight)
        layer.qweight = _param(q)
        layer.scales = _param(scales.to(self.compute_dtype))

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype).contiguous()
        if x.shape[0] <= INT8_KERNEL_MAX_ROWS:
            return torch._weight_int8pack_mm(x, layer.qweight, layer.scales)
        # Per-channel scales factor out of the matmul: only the int8 -> bf16 cast is per call.
        return F.linear(x, layer.qweight.to(self.compute_dtype)) * layer.scales

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_int8(layer.qweight, layer.scales)


def unpack_int4_cpu_t(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Transposed codes ``[k, n]`` (uint8) of a ``_convert_weight_to_int4pack_for_cpu`` weight.

    The layout is PyTorch's internal one (torch 2.13, read off the op), which depends on the
    CPU: rows in blocks of ``int4_pack_block()`` (64 with AVX-512, 32 with AVX2), ``[k, block/2]``
    bytes per block with row j in the low and row j + block/2 in the high nibble, then a tail
    block of ``n % block`` rows stored ``[k, tail / 2]`` with row pairs sharing a byte.
    ``CpuInt4Method.quantize_weights`` checks it on every layer and stops relying on it if it
    changes. Transposed because that is the cheap direction: whole runs are copied. ValueError
    where the layout is neither of these."""
    block = int4_pack_block()
    if block is None:
        raise ValueError("torch's CPU int4 packing has a layout pagellm does not know")
    return _unpack_int4_blocks(packed, n, k, block)


def _unpack_int4_blocks(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    half = block // 2
    main = n - n % block
    parts = []
    if main:
        b = packed[:main].reshape(main // block, k, half)
        lo_hi = torch.stack([b & 0xF, b >> 4], dim=2)  # [blocks, k, 2, half]
        parts.append(lo_hi.permute(1, 0, 2, 3).reshape(k, main))
    if n % block:
        tail = packed[main:].reshape(k, (n % block) // 2)
        parts.append(torch.stack([tail & 0xF, tail >> 4], dim=-1).reshape(k, n % block))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


@functools.cache
def int4_pack_block() -> int | None:
    """The row block of torch's CPU int4 packing on this machine (64 or 32), found by packing a
    probe whose shape has whole blocks of both sizes and a tail; None: another layout."""
    n, k = 112, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(0))
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    for block in (64, 32):
        if torch.equal(_unpack_int4_blocks(packed, n, k, block).t(), codes):
            return block
    return None


def unpack_int4_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return unpack_int4_cpu_t(packed, n, k).t()


class CpuInt4Method(QuantizedLinearMethod):
    # The op packs rows in multiples of 16: smaller layers get zero rows, sliced off the output.
    def quantize_weights(self, layer: nn.Module, weight: torch.Tensor) -> None:
        self.compute_dtype = torch.bfloat16 if self.dtype == torch.float32 else self.dtype
        codes, scales, mins = quantize_int4(weight, self.group_size)
        self.padded_n = -(-self.out_features // 16) * 16
        pad = self.padded_n - self.out_features
        codes, scales, mins = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scales, mins))
        packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        # The op computes (q - 8) * scale + zero: zero = min + 8 * scale. Layout [G, N, 2].
        sz = torch.stack([scales, mins + 8 * scales], dim=-1).transpose(0, 1).contiguous()
        layer.qweight = _param(packed)
        layer.scales_and_zeros = _param(sz.to(self.compute_dtype))
        self.layout_known = int4_pack_block() is not None and torch.equal(
            unpack_int4_cpu(packed, self.padded_n, self.in_features), codes)

    def codes_t(self, layer: nn.Module) -> torch.Tensor:
        if self.layout_known:
            return unpack_int4_cpu_t(layer.qweight, self.padded_n, self.in_features)
        # Unknown packing: read the codes back through the op itself (slow; never in practice).
        k, g = self.in_features, self.group_size
        ones = torch.ones(k // g, self.padded_n, 2, dtype=self.compute_dtype)
        ones[..., 1] = 8.0  # scale 1, zero 8: the op returns the raw codes
        eye = torch.eye(k, dtype=self.compute_dtype)
        out = torch._weight_int4pack_mm_for_cpu(eye, layer.qweight, g, ones)
        return out.round().to(torch.uint8)

    def _weight_t(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """``W^T`` ``[K, padded N]`` in ``dtype``. The math runs in float32 (exact codes, one
        rounding, and faster than bf16 elementwise math on CPU), a few groups at a time so the
        float32 temporaries stay in cache."""
        n, k, g = self.padded_n, self.in_features, self.group_size
        sz = layer.scales_and_zeros.float()  # [G, N, 2]
        scales = sz[..., 0].unsqueeze(1)
        mins = (sz[..., 1] - 8 * sz[..., 0]).unsqueeze(1)
        codes = self.codes_t(layer).view(k // g, g, n)
        out = torch.empty(k // g, g, n, dtype=dtype, device=codes.device)
        step = max(1, _DEQUANT_CHUNK // (g * n))
        for i in range(0, k // g, step):
            torch.addcmul(mins[i : i + step], codes[i : i + step].float(), scales[i : i + step],
                          out=out[i : i + step])
        return out.view(k, n)

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.compute_dtype).contiguous()
        if x.shape[0] <= INT4_KERNEL_MAX_ROWS or not self.layout_known:
            y = torch._weight_int4pack_mm_for_cpu(x, layer.qweight, self.group_size,
                                                  layer.scales_and_zeros)
        else:
            y = torch.mm(x, self._weight_t(layer, self.compute_dtype))
        return y[:, : self.out_features] if self.padded_n != self.out_features else y

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self._weight_t(layer, torch.float32).t()[: self.out_features]


class TorchDequantMethod(QuantizedLinearMethod):
    """Plain layout (int8 ``[N, K]``; int4 two codes per byte), dequantized on every call."""

    def quantize_weights(self, layer: nn.Module, weight: torch.Tensor) -> None:
        if self.method == "int8":
            q, scales = quantize_int8(weight)
            layer.qweight = _param(q)
            layer.scales = _param(scales.to(self.dtype))
        else:
            codes, scales, mins = quantize_int4(weight, self.group_size)
            layer.qweight = _param(pack_int4(codes))
            layer.scales = _param(scales.to(self.dtype))
            layer.mins = _param(mins.to(self.dtype))

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        if self.method == "int8":
            return dequantize_int8(layer.qweight, layer.scales)
        return dequantize_int4(unpack_int4(layer.qweight), layer.scales, layer.mins)

    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.method == "int8":
            return F.linear(x, layer.qweight.to(x.dtype)) * layer.scales
        return F.linear(x, self.dequantize(layer).to(x.dtype))


class TritonMethod(TorchDequantMethod):
    def matmul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from pagellm.layers.triton_quant import wq_matmul

        mins = layer.mins if self.method == "int4" else None
        return wq_matmul(x.contiguous(), layer.qweight, layer.scales, mins, self.group_size)


# backend -> method -> class (method_factory.make_linear_method picks one per layer)
QUANT_METHODS: dict[str, dict[str, type[QuantizedLinearMethod]]] = {
    "cpu": {"int8": CpuInt8Method, "int4": CpuInt4Method},
    "torch": {"int8": TorchDequantMethod, "int4": TorchDequantMethod},
    "triton": {"int8": TritonMethod, "int4": TritonMethod},
}
