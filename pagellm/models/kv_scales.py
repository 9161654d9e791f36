"""Per-tensor K/V cache scales a checkpoint may carry for an fp8 KV cache (--kv-cache-dtype fp8),
read under the names vLLM reads: ``*.self_attn.k_scale`` / ``v_scale``,
``*.self_attn.k_proj.output_scale`` / ``v_proj.output_scale`` and the older shared
``*.self_attn.kv_scale``. Each lands on the layer's ``Attention`` (``k_scale``/``v_scale``, 1.0
without one); a scale of several elements counts as its largest. int8_per_token_head computes
its own scales and ignores these, as does a float cache.
"""

from __future__ import annotations

import torch
from torch import nn

_SUFFIXES = {
    ".k_scale": ("k",), ".v_scale": ("v",), ".k_proj.output_scale": ("k",),
    ".v_proj.output_scale": ("v",), ".kv_scale": ("k", "v"),
}


def load_kv_scale(model: nn.Module, ckpt_name: str, tensor: torch.Tensor) -> bool:
    """Put a checkpoint's K/V scale on its attention layer; False when ``ckpt_name`` is not
    one (the caller loads it as a weight)."""
    for suffix, which in _SUFFIXES.items():
        if not ckpt_name.endswith(suffix) or ".self_attn" not in ckpt_name:
            continue
        prefix = ckpt_name[: -len(suffix)].removesuffix(".self_attn") + ".self_attn"
        attn = dict(model.named_modules()).get(prefix + ".attn")
        if attn is None:
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: no attention layer "
                             f"{prefix}.attn for this KV cache scale")
        value = float(tensor.float().max())
        if not value > 0:
            raise ValueError(f"checkpoint tensor {ckpt_name!r}: a KV cache scale must be > 0, "
                             f"got {value}")
        for w in which:
            setattr(attn, f"{w}_scale", value)
        return True
    return False
