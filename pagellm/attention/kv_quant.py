"""8-bit KV cache values in torch: quantize on write, dequantize what a backend gathers.

The reference every kernel is tested against (``--kv-cache-dtype``, pagellm/kv_cache_dtype.py):
- fp8 (``fp8_e4m3``, ``fp8_e5m2``): ``stored = fp8(clamp(x / scale))`` with one float scale per
  layer for K and one for V (1.0 unless the checkpoint carries them); the cache tensors are
  ``uint8`` holding the fp8 bits (torch has few CPU ops on float8 tensors);
- ``int8_per_token_head``: ``scale = bf16(absmax(x[token, head, :]) / 127)`` (rounded to
  nearest even), ``stored = clamp(round(x / scale), -127, 127)`` (half to even) as ``int8``;
  the scales live in their own bfloat16
  ``[num_blocks, block_size, kv_heads]`` tensors, indexed by the same block ids as the values.
Dequantized values are float32; the torch backend turns them into the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
INT8_MAX = 127.0
# The dtype of int8_per_token_head's scales (2 bytes beside each row of head_dim bytes).
SCALE_DTYPE = torch.bfloat16


@dataclass(slots=True)
class KVQuant:
    """One layer's quantized-cache state, beside its ``(k_cache, v_cache)``: ``kind``
    (``fp8_e4m3``, ``fp8_e5m2`` or ``int8_per_token_head``), the per-tensor ``k_scale`` and
    ``v_scale`` (fp8), and for int8 the per-(token, head) scale tensors ``k_scales``/``v_scales``
    ``[num_blocks, block_size, kv_heads]`` bfloat16."""

    kind: str
    k_scale: float = 1.0
    v_scale: float = 1.0
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None


def storage_dtype(kind: str) -> torch.dtype:
    """The cache tensors' dtype for a quantized kind."""
    return torch.int8 if kind == "int8_per_token_head" else torch.uint8


def quantize_fp8(x: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """``x`` (any float dtype) as fp8 bits in ``uint8``: divided by ``scale``, saturated."""
    limit = FP8_MAX[kind]
    y = (x.float() / scale).clamp(-limit, limit)
    return y.to(FP8_DTYPES[kind]).view(torch.uint8)


def dequantize_fp8(bits: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    return bits.view(FP8_DTYPES[kind]).float() * scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (int8 values, bfloat16 scale per row ``[...]``), symmetric absmax/127
    rounded to bfloat16 (the values are divided by the rounded scale). A row of zeros gets
    scale 0 and values 0."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / INT8_MAX).to(SCALE_DTYPE)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = torch.round(xf / safe[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[..., None]


def quantize(x: torch.Tensor, quant: KVQuant, which: str) -> tuple[torch.Tensor,
                                                                    torch.Tensor | None]:
    """``x`` as stored for cache ``which`` ("k" or "v"): (values, per-row scales or None)."""
    if quant.kind == "int8_per_token_head":
        return quantize_int8(x)
    scale = quant.k_scale if which == "k" else quant.v_scale
    return quantize_fp8(x, quant.kind, scale), None


def dequantize(values: torch.Tensor, scales: torch.Tensor | None, quant: KVQuant,
               which: str) -> torch.Tensor:
    """Stored values (and their per-row scales for int8) back as float32."""
    if quant.kind == "int8_per_token_head":
        assert scales is not None
        return dequantize_int8(values, scales)
    return dequantize_fp8(values, quant.kind, quant.k_scale if which == "k" else quant.v_scale)


def write_kv_quant(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, quant: KVQuant) -> None:
    """Quantize ``key/value [T, Hkv, D]`` into flat slots ``slot_mapping [T]``."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    slots = slot_mapping.to(torch.long)
    for which, x, cache in (("k", key, k_cache), ("v", value, v_cache)):
        q, scales = quantize(x, quant, which)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, q)
        if scales is not None:
            table = quant.k_scales if which == "k" else quant.v_scales
            assert table is not None
            table.view(-1, num_kv_heads).index_copy_(0, slots, scales)


def dequantize_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, quant: KVQuant
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole caches as float32 (tests' reference only: the backends never do this)."""
    return (dequantize(k_cache, quant.k_scales, quant, "k"),
            dequantize(v_cache, quant.v_scales, quant, "v"))
