"""Qwen3 (dense): Llama's layout plus an RMSNorm over each head of q and k before rotary; q/k/v
and o biases follow ``attention_bias`` (off in released checkpoints), head_dim from the config.

The fused CPU step (llama_cpu_fused.py) has no q/k norm: it refuses these layers because their
attention's forward is not LlamaAttention's, so they run through the modules.
"""

from __future__ import annotations

from typing import Any

import torch

from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.models.llama import LlamaAttention, get_head_dim
from pagellm.models.qwen2 import Qwen2ForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 qkv_bias: bool, o_bias: bool) -> None:
        super().__init__(config, layer_idx, rotary_emb, qkv_bias, o_bias)
        self.head_dim = get_head_dim(config)
        # Per-head weights: replicated on every tensor-parallel rank.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _head_norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        out = norm(x.reshape(-1, self.head_dim))  # [T * heads, D]: one row per head
        assert isinstance(out, torch.Tensor)
        return out.view(num_tokens, -1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2's sliding-window reading (only with use_sliding_window), Llama's biases."""

    attention_cls = Qwen3Attention
    qk_norm = True  # read by pagellm plan (its weight bytes)

    @staticmethod
    def attention_bias(config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias
