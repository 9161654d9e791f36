"""Gemma 2 (and, through gemma3.py, Gemma 3 text): Llama's tensors with Gemma's differences.

- RMSNorm scales by ``1 + w`` in float32 (GemmaRMSNorm); four norms per layer: before and
  after attention, before and after the MLP (the "post" norms apply to the branch output
  before it joins the residual).
- GeGLU MLP (gelu, tanh approximation); embeddings multiplied by sqrt(hidden_size), rounded to
  the model dtype first as transformers does; tied LM head.
- Attention scale ``query_pre_attn_scalar ** -0.5``; scores soft-capped at
  ``attn_logit_softcapping`` and final logits at ``final_logit_softcapping`` (Gemma 2).
- Sliding-window layers interleaved with global ones (``layer_types``; Gemma 2 alternates, the
  first sliding).

The fused CPU step (llama_cpu_fused.py) is Llama's only: these layers run through the modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.layers.activation import GeluTanhAndMul
from pagellm.layers.attention import Attention
from pagellm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagellm.layers.norm import GemmaRMSNorm
from pagellm.layers.rotary import RotaryEmbedding, get_rope
from pagellm.models.llama import LlamaForCausalLM, get_head_dim, rope_table_len

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")


def gemma_layer_types(config: Any, default_pattern: int = 2) -> list[str]:
    """``"sliding_attention"`` / ``"full_attention"`` per layer: the config's ``layer_types``,
    else every ``sliding_window_pattern``-th layer global (Gemma 2: 2, Gemma 3: 6)."""
    types = getattr(config, "layer_types", None)
    n = int(config.num_hidden_layers)
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return list(types)
    pattern = int(getattr(config, "sliding_window_pattern", None) or default_pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in _GELU_TANH:
            raise ValueError(f"hidden_activation {hidden_act!r} is not supported (Gemma: "
                             "'gelu_pytorch_tanh')")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 sliding_window: int | None, qk_norm: bool) -> None:
        super().__init__()
        head_dim = get_head_dim(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads,
                                          bias=bias)
        self.q_size = self.qkv_proj.num_heads * head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=bias)
        self.rotary_emb = rotary_emb
        # Gemma 3: an RMSNorm over each head of q and k (per-head weights: replicated).
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        scalar = getattr(config, "query_pre_attn_scalar", None) or head_dim
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, self.qkv_proj.num_kv_heads,
                              float(scalar) ** -0.5, layer_idx, sliding_window=sliding_window,
                              logits_soft_cap=getattr(config, "attn_logit_softcapping", None))

    def _head_norm(self, norm: GemmaRMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(-1, self.head_dim)).view(x.shape[0], -1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 sliding_window: int | None, qk_norm: bool) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        self.self_attn = Gemma2Attention(config, layer_idx, rotary_emb, sliding_window, qk_norm)
        self.mlp = GemmaMLP(h, config.intermediate_size, act)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        branch = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(branch)
        branch = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(branch)


class Gemma2Model(nn.Module):
    def __init__(self, config: Any, windows: list[int | None], ropes: list[RotaryEmbedding],
                 qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, i, ropes[i], windows[i], qk_norm)
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers rounds sqrt(hidden_size) to the activation dtype before multiplying.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Gemma2ForCausalLM(LlamaForCausalLM):
    # Read by pagellm plan (its weight bytes): Gemma 3 adds q/k norms.
    qk_norm = False
    norms_per_layer = 4
    sliding_window_pattern = 2  # without layer_types: every 2nd layer global

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.layer_windows = self.layer_sliding_windows(config)
        ropes = self.make_ropes(config, max_model_len)
        self.model = Gemma2Model(config, self.layer_windows, ropes, self.qk_norm)
        # Gemma ties its LM head to the embeddings (checkpoints store no lm_head).
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        attn = self.model.layers[0].self_attn.attn
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.max_position = rope_table_len(config, max_model_len)

    def make_ropes(self, config: Any, max_model_len: int | None) -> list[RotaryEmbedding]:
        """One rotary table shared by every layer (Gemma 3 has one per layer type)."""
        rope = get_rope(get_head_dim(config), rope_table_len(config, max_model_len), config,
                        max_model_len)
        return [rope] * int(config.num_hidden_layers)

    @staticmethod
    def get_sliding_window(config: Any) -> int | None:
        window = getattr(config, "sliding_window", None)
        return int(window) if window else None

    @classmethod
    def layer_sliding_windows(cls, config: Any) -> list[int | None]:
        window = cls.get_sliding_window(config)
        return [window if t == "sliding_attention" and window else None
                for t in gemma_layer_types(config, cls.sliding_window_pattern)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
