"""Granite 4 hybrids (``GraniteMoeHybridForCausalLM``, model_type ``granitemoehybrid``): Mamba-2
layers and attention layers (``config.layer_types``), each followed by a MoE (softmax over the
top-k router logits) plus an always-on shared SiLU MLP, or by the shared MLP alone when
``num_local_experts`` is 0.

Granite's scalars: embeddings times ``embedding_multiplier``; each sublayer's output times
``residual_multiplier`` before its residual add; attention scores scaled by
``attention_multiplier`` (not 1/sqrt(head_dim)); logits divided by ``logits_scaling``. Attention
has rotary where ``position_embedding_type`` is ``"rope"``, none for ``"nope"`` (or unset).

Checkpoints stack the experts: ``block_sparse_moe.input_linear.weight [E, 2I, H]`` (each
expert's gate rows, then its up rows), ``output_linear.weight [E, H, I]``, the router in
``router.layer.weight``, the shared MLP in ``shared_mlp.input_linear`` (gate | up) and
``output_linear``. transformers 5 writes these names too (and reads ``experts.gate_up_proj`` /
``experts.down_proj`` / ``router.weight``, accepted here as well). They are split into per-expert
and gate/up tensors for the MoE and Llama loaders.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.layers.fused_moe import FusedMoE, MoeRouter
from pagellm.layers.mamba2_mixer import Mamba2Layer, Mamba2Spec
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding, get_rope
from pagellm.models.llama import LlamaForCausalLM, LlamaMLP, get_head_dim, rope_table_len
from pagellm.models.mamba_hybrid import (
    MAMBA,
    HybridAttention,
    Mamba2StateMixin,
    give_weight_loaders,
    mixer_kind,
    refuse_tensor_parallel,
)
from pagellm.models.moe import MoeWeightsMixin

_POSITION_TYPES = (None, "rope", "nope")


def _kinds(config: Any) -> list[str]:
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} "
                         f"layers")
    return [mixer_kind(t, "layer_types") for t in types]


class GraniteMoe(nn.Module):
    """Router + stacked experts (``block_sparse_moe`` in checkpoints)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        experts = int(config.num_local_experts)
        self.router = MoeRouter(config.hidden_size, experts)
        # softmax over the top-k logits == top-k of the softmax, renormalized.
        self.experts = FusedMoE(experts, int(config.num_experts_per_tok), config.hidden_size,
                                config.intermediate_size, renormalize=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GraniteHybridLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, kind: str,
                 rotary_emb: RotaryEmbedding | None) -> None:
        super().__init__()
        self.is_mamba = kind == MAMBA
        if self.is_mamba:
            self.mamba = Mamba2Layer(Mamba2Spec.from_config(config), layer_idx)
            give_weight_loaders(self.mamba)
        else:
            self.self_attn = HybridAttention(config, layer_idx, rotary_emb,
                                             float(config.attention_multiplier),
                                             bool(config.attention_bias))
        self.mlp = GraniteMoe(config) if int(config.num_local_experts or 0) > 0 else None
        self.shared_mlp = LlamaMLP(config.hidden_size, config.shared_intermediate_size,
                                   config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(hidden)
        h = self.mamba(h) if self.is_mamba else self.self_attn(positions, h)
        hidden = hidden + h * self.residual_multiplier
        h = self.post_attention_layernorm(hidden)
        out = self.shared_mlp(h)
        if self.mlp is not None:
            out = self.mlp(h) + out
        return hidden + out * self.residual_multiplier


class GraniteHybridModel(nn.Module):
    def __init__(self, config: Any, max_model_len: int | None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = None
        if config.position_embedding_type == "rope":
            rotary_emb = get_rope(get_head_dim(config), rope_table_len(config, max_model_len),
                                  config, max_model_len)
        self.layers = nn.ModuleList(GraniteHybridLayer(config, i, kind, rotary_emb)
                                    for i, kind in enumerate(_kinds(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embedding_multiplier
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class GraniteMoeHybridForCausalLM(Mamba2StateMixin, MoeWeightsMixin, LlamaForCausalLM):
    moe_block_name = "block_sparse_moe"

    def __init__(self, config: Any, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        refuse_tensor_parallel(type(self).__name__)
        if config.position_embedding_type not in _POSITION_TYPES:
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is "
                             f"not supported (one of {_POSITION_TYPES})")
        self._expert_shards = {}
        self.config = config
        self.model = GraniteHybridModel(config, max_model_len)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_scaling = float(config.logits_scaling)
        attn = next(layer.self_attn.attn for layer in self.model.layers if not layer.is_mamba)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.max_position = rope_table_len(config, max_model_len)
        self.layer_windows = self.layer_sliding_windows(config)

    @staticmethod
    def layer_sliding_windows(config: Any) -> list[int | None]:
        return [None] * int(config.num_hidden_layers)

    layer_kinds = staticmethod(_kinds)

    @staticmethod
    def moe_layout(config: Any) -> tuple[int, int, int, int]:
        """(experts, top-k, expert width, MoE layers), read by pagellm plan."""
        experts = int(config.num_local_experts or 0)
        if not experts:
            return (0, 0, 0, 0)
        return (experts, int(config.num_experts_per_tok), int(config.intermediate_size),
                int(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden) / self.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self.checkpoint_weights(weights))

    @staticmethod
    def checkpoint_weights(weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under the names the loaders take (weight updates too)."""
        return _split_stacked(weights)


def _split_stacked(weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Granite's stacked experts as per-expert ``gate_proj``/``up_proj``/``down_proj`` tensors,
    its shared MLP's ``input_linear`` as gate and up, the router under our name."""
    moe, shared = ".block_sparse_moe.", ".shared_mlp."
    for name, t in weights:
        prefix, _, rest = name.partition(moe)
        if rest in ("input_linear.weight", "experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}{moe}experts.{e}.gate_proj.weight", t[e, :half]
                yield f"{prefix}{moe}experts.{e}.up_proj.weight", t[e, half:]
        elif rest in ("output_linear.weight", "experts.down_proj"):
            for e in range(t.shape[0]):
                yield f"{prefix}{moe}experts.{e}.down_proj.weight", t[e]
        elif rest == "router.layer.weight":
            yield f"{prefix}{moe}router.weight", t
        elif name.endswith(f"{shared}input_linear.weight"):
            base, half = name.removesuffix("input_linear.weight"), t.shape[0] // 2
            yield f"{base}gate_proj.weight", t[:half]
            yield f"{base}up_proj.weight", t[half:]
        elif name.endswith(f"{shared}output_linear.weight"):
            yield name.replace(f"{shared}output_linear.", f"{shared}down_proj."), t
        else:
            yield name, t
