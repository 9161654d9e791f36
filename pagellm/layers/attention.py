"""The attention layer models use: reads the step's metadata and KV cache from the forward context.

Models never see block tables. Without metadata (a profiling or warm-up run) the whole flat
batch is attended causally as one sequence and nothing is written to any cache.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.attention.registry import get_attn_backend_cls
from pagellm.attention.torch_backend import causal_attention
from pagellm.forward_context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 layer_idx: int, backend_name: str | None = None,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        """``sliding_window``/``logits_soft_cap``: see AttentionBackend."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        self.backend_name = backend_name
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # The KV cache group whose block tables this layer reads (core/kv_cache_groups.py): set
        # by the model runner for models with several groups.
        self.kv_cache_group = 0
        # Per-tensor K/V scales of an fp8 KV cache (--kv-cache-dtype): the checkpoint's
        # k_scale/v_scale where it carries them (models/kv_scales.py), else 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # Built on first use: the backend may depend on the device the activations live on.
        self._backend: AttentionBackend | None = None

    def get_backend(self, device: torch.device) -> AttentionBackend:
        if self._backend is None:
            cls = get_attn_backend_cls(self.backend_name, device)
            self._backend = cls(self.num_heads, self.head_dim, self.num_kv_heads, self.scale,
                                self.sliding_window, self.logits_soft_cap)
        return self._backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q [T, Hq*D]``, ``k/v [T, Hkv*D]`` -> ``[T, Hq*D]``."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        if meta is None:
            out = causal_attention(q, k, v, self.scale, self.sliding_window,
                                   self.logits_soft_cap)
        else:
            k_cache, v_cache = ctx.kv_caches[self.layer_idx]
            backend = self.get_backend(q.device)
            group_meta = meta.for_group(self.kv_cache_group)
            if ctx.kv_quant is None:
                out = backend.forward(q, k, v, k_cache, v_cache, group_meta)
            else:
                out = backend.forward(q, k, v, k_cache, v_cache, group_meta,
                                      kv_quant=ctx.kv_quant[self.layer_idx])
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
