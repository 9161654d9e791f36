"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers with gated full attention every few
layers (``config.layer_types``), MoE with a gated shared expert (or a dense MLP).

- Full attention: q_proj yields each head's query and an output gate side by side;
  ``o_proj(attn * sigmoid(gate))``; q/k RMSNorm per head; rotary on a part of each head
  (``partial_rotary_factor``). Its KV goes to the paged cache as any attention layer's.
- Linear attention (layers/gated_deltanet.py): state in a per-request slot, no KV.
- Every RMSNorm but the gated one scales by ``1 + weight`` (GemmaRMSNorm).
- Sparse layers: routed experts (FusedMoE) plus ``sigmoid(shared_expert_gate(x)) *
  shared_expert(x)``; which layers are sparse follows Qwen3-MoE's rule.

Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``)
keep the language model under ``model.language_model.``; only their text part is built here.
Its multi-axis rotary equals 1-D rotary for text, where every axis has the token's position.
Multi-token-prediction heads (``mtp.*``) are skipped, with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.layers.attention import Attention
from pagellm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.layers.fused_moe import FusedMoE, MoeRouter
from pagellm.layers.gated_deltanet import GatedDeltaNet, gdn_dims, gdn_state_shapes
from pagellm.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from pagellm.layers.norm import GemmaRMSNorm
from pagellm.layers.rotary import RotaryEmbedding, get_rope
from pagellm.models.llama import LlamaForCausalLM, LlamaMLP, get_head_dim, rope_table_len
from pagellm.models.moe import MoeWeightsMixin
from pagellm.models.qwen3_moe import is_sparse_layer

logger = logging.getLogger("pagellm")


def text_config(config: Any) -> Any:
    """The language model's config (Qwen3.5's ``text_config``), or the config itself."""
    return getattr(config, "text_config", None) or config


class GatedAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        head_dim = get_head_dim(config)
        # q_proj holds [query, gate] per head: as QKV's "q" it is 2 x heads of head_dim.
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim,
                                          2 * config.num_attention_heads,
                                          config.num_key_value_heads,
                                          bias=bool(getattr(config, "attention_bias", False)))
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=bool(getattr(config, "attention_bias", False)))
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5,
                              layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        q_size, kv_size = 2 * self.num_heads * d, self.num_kv_heads * d
        qg, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q.reshape(-1, d)).view(t, -1)
        k = self.k_norm(k.reshape(-1, d)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.contiguous())
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class SharedExpertMoeBlock(nn.Module):
    """Routed experts plus a shared expert scaled by a sigmoid gate (Qwen2-MoE, Qwen3-Next)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = MoeRouter(hidden, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, hidden,
                                config.moe_intermediate_size,
                                bool(getattr(config, "norm_topk_prob", True)))
        self.shared_expert = LlamaMLP(hidden, config.shared_expert_intermediate_size,
                                      config.hidden_act)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, self.gate(x))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding,
                 fused_projections: bool) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx, fused_projections)
        else:
            self.self_attn = GatedAttention(config, layer_idx, rotary_emb)
        if int(getattr(config, "num_experts", 0) or 0) and is_sparse_layer(config, layer_idx):
            self.mlp: nn.Module = SharedExpertMoeBlock(config)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        h = self.linear_attn(h) if self.is_linear else self.self_attn(positions, h)
        hidden = hidden + h
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class HybridModel(nn.Module):
    def __init__(self, config: Any, max_model_len: int | None, fused_projections: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(get_head_dim(config), rope_table_len(config, max_model_len),
                              config, max_model_len)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i, rotary_emb, fused_projections)
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class Qwen3NextForCausalLM(MoeWeightsMixin, LlamaForCausalLM):
    fused_projections = True
    # The gated attention's q/k/v fuse as Llama's; gate/up of dense MLPs and shared experts.
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self._expert_shards = {}
        full_config = config
        config = text_config(config)
        self.config = full_config
        self.text_config = config
        self.model = HybridModel(config, max_model_len, self.fused_projections)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings",
                                                getattr(full_config, "tie_word_embeddings",
                                                        False)))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        attn = next(layer.self_attn.attn for layer in self.model.layers if not layer.is_linear)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.max_position = rope_table_len(config, max_model_len)
        self.layer_windows = self.layer_sliding_windows(full_config)

    @staticmethod
    def layer_sliding_windows(config: Any) -> list[int | None]:
        return [None] * int(text_config(config).num_hidden_layers)

    @staticmethod
    def recurrent_layers(config: Any) -> tuple[int, ...]:
        types = text_config(config).layer_types
        return tuple(i for i, t in enumerate(types) if t == "linear_attention")

    @staticmethod
    def recurrent_state_shapes(config: Any, tp_size: int) -> tuple[tuple[tuple[int, ...], bool],
                                                                    ...]:
        return gdn_state_shapes(text_config(config), tp_size)

    attention_output_gate = True  # read by pagellm plan
    qk_norm = True

    @staticmethod
    def recurrent_layer_params(config: Any) -> int:
        """Parameters of one Gated DeltaNet layer (pagellm plan's weight count)."""
        c = text_config(config)
        hk, hv, dk, dv = gdn_dims(c, 1)
        key_dim, value_dim = hk * dk, hv * dv
        proj = (2 * key_dim + 2 * value_dim + 2 * hv) * c.hidden_size
        conv = (2 * key_dim + value_dim) * int(c.linear_conv_kernel_dim)
        return proj + conv + 2 * hv + dv + value_dim * c.hidden_size

    @staticmethod
    def moe_layout(config: Any) -> tuple[int, int, int, int]:
        """(experts, top-k, expert width, MoE layers), read by pagellm plan."""
        config = text_config(config)
        experts = int(getattr(config, "num_experts", 0) or 0)
        if not experts:
            return (0, 0, 0, 0)
        layers = sum(is_sparse_layer(config, i) for i in range(config.num_hidden_layers))
        return (experts, int(config.num_experts_per_tok), int(config.moe_intermediate_size),
                layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self.checkpoint_weights(weights))

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The language model's tensors under this model's names: Qwen3.5's
        ``model.language_model.`` prefix dropped; vision tower and MTP heads skipped."""
        skipped = {"mtp": 0, "visual": 0}
        for name, tensor in weights:
            if name.startswith("mtp.") or ".mtp." in name:
                skipped["mtp"] += 1
                continue
            if name.startswith(("model.visual.", "visual.")):
                skipped["visual"] += 1
                continue
            yield name.replace("model.language_model.", "model.", 1), tensor
        if skipped["mtp"]:
            logger.info("Skipped %d multi-token-prediction tensors (mtp.*): pagellm does not "
                        "use MTP heads", skipped["mtp"])
        if skipped["visual"]:
            logger.info("Skipped %d vision tower tensors: image input is not supported for "
                        "this model", skipped["visual"])


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense or MoE): Qwen3-Next's layers with unfused linear-attention projections."""

    fused_projections = False
