"""Rotary position embedding (rotate-half / GPT-NeoX layout, as Hugging Face Llama and Qwen2).

The cos/sin table is computed once in float32, the way ``transformers`` computes it, and indexed
by position; the rotation runs in the activation dtype, as in ``transformers``.

LongRoPE (Phi-3's ``longrope``/``su``) has two sets of per-dimension factors. transformers
switches from the short to the long ones once the running sequence passes
``original_max_position_embeddings``, which a shared paged KV cache cannot follow (keys already
cached keep their rotation). Like vLLM we choose once: the long factors when the engine's
max_model_len is past ``original_max_position_embeddings``, else the short ones. The two agree for
every sequence when max_model_len is at most the original length, and for sequences longer than
it otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm.kernels import cpu_ops
from pagellm.layers.fused_ops import triton_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def get_rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of an HF config as one dict with ``rope_type`` and ``rope_theta``.

    transformers >= 5 keeps them in ``config.rope_parameters``; older versions spread them over
    ``config.rope_theta`` and ``config.rope_scaling`` (whose type key may be ``type``).
    """
    params = getattr(config, "rope_parameters", None)
    if params and "rope_type" not in params and "rope_theta" not in params:
        raise ValueError(f"per-layer-type rope_parameters are not supported: {params}")
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    if params["rope_type"] == "su":  # Phi-3's first name for longrope
        params["rope_type"] = "longrope"
    if params["rope_type"] == "longrope":
        # Older configs keep these at the top level; the default factor is their ratio.
        original = getattr(config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings", original)
        params.setdefault("max_position_embeddings", config.max_position_embeddings)
        if params["original_max_position_embeddings"] is None:
            raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    return params


def _longrope_factor(params: dict[str, Any]) -> float:
    factor = params.get("factor")
    if factor is None:
        factor = params["max_position_embeddings"] / params["original_max_position_embeddings"]
    return factor


def attention_scaling(params: dict[str, Any]) -> float:
    """The factor transformers multiplies cos and sin by (longrope's; 1.0 for the others)."""
    if params["rope_type"] != "longrope":
        return 1.0
    scaling = params.get("attention_factor")
    if scaling is None:
        factor = _longrope_factor(params)
        original = params["original_max_position_embeddings"]
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return float(scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(
            f"rope_type {rope_type!r} is not supported (supported: {supported})"
            + ("; 'dynamic' rope depends on the running sequence length, which a shared paged KV "
               "cache cannot follow" if rope_type == "dynamic" else "")
        )
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    if rope_type == "longrope":
        # ``use_long_factor``: get_rope's static choice (module docstring).
        key = "long_factor" if params.get("use_long_factor") else "short_factor"
        ext_factors = torch.tensor(params[key], dtype=torch.float32, device="cpu")
        if ext_factors.shape != (rotary_dim // 2,):
            raise ValueError(f"longrope {key} has {ext_factors.numel()} values, the rotary dim "
                             f"{rotary_dim} needs {rotary_dim // 2}")
        return 1.0 / (ext_factors * base ** (exponents / rotary_dim))
    inv_freq = 1.0 / (base ** (exponents / rotary_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int,
                 rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(rotary_dim, rope_parameters)
        t = torch.arange(max_position, dtype=torch.int64, device="cpu").float()
        freqs = t[:, None] * inv_freq[None, :]
        device = torch.get_default_device()
        scaling = attention_scaling(rope_parameters)
        cos, sin = freqs.cos(), freqs.sin()
        if scaling != 1.0:  # folded into the table, as transformers scales cos/sin in float32
            cos, sin = cos * scaling, sin * scaling
        # NOTE: kept float32 whatever the model dtype; cast at use like transformers.
        self.register_buffer("cos_cache", cos.to(device), persistent=False)
        self.register_buffer("sin_cache", sin.to(device), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if rest.shape[-1]:
            out = torch.cat((out, rest), dim=-1)
        return out.reshape(num_tokens, -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, Hq*D]`` and ``k [T, Hk*D]`` by their tokens' ``positions [T]``.

        On CPU and on CUDA (Triton) the rotation happens in place (q and k are the model's fresh
        QKV projection) and the same tensors come back."""
        if q.dim() == 2 and cpu_ops.supports(q, k):
            cpu_ops.rotary_(q, k, positions, self.cos_cache, self.sin_cache, self.head_dim)
            return q, k
        if (q.dim() == 2 and q.is_cuda and self.cos_cache.device == q.device
                and (ops := triton_ops()) is not None and ops.supports(q, k)):
            ops.rotary_(q, k, positions, self.cos_cache, self.sin_cache, self.head_dim)
            return q, k
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path (the reference of both kernels): new tensors, q and k untouched."""
        cos = self.cos_cache.index_select(0, positions).to(q.dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def get_rope(head_dim: int, max_position: int, config: Any,
             max_model_len: int | None = None) -> RotaryEmbedding:
    """``max_position``: rows of the table; ``max_model_len`` (None: the config's
    max_position_embeddings) picks longrope's factors."""
    params = get_rope_parameters(config)
    if params["rope_type"] == "longrope":
        context = max_model_len or config.max_position_embeddings
        params["use_long_factor"] = context > params["original_max_position_embeddings"]
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * (partial or 1.0))
    return RotaryEmbedding(head_dim, rotary_dim, max_position, params)
