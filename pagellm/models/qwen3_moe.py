"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with a sparse MoE block as ``mlp``.

As transformers builds it, layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``; other layers keep the dense MLP (``intermediate_size``),
the experts use ``moe_intermediate_size``. ``norm_topk_prob`` chooses whether the top-k routing
weights are renormalized.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagellm.layers.fused_moe import SparseMoeBlock
from pagellm.models.moe import MoeWeightsMixin
from pagellm.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer choice (also read by pagellm plan)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and int(config.num_experts) > 0 and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(MoeWeightsMixin, Qwen3ForCausalLM):
    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module | None:
        if not is_sparse_layer(config, layer_idx):
            return None
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        return SparseMoeBlock(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                              config.moe_intermediate_size,
                              renormalize=bool(getattr(config, "norm_topk_prob", False)))

    @staticmethod
    def moe_layout(config: Any) -> tuple[int, int, int, int]:
        """(experts, top-k, expert width, MoE layers), read by pagellm plan."""
        layers = sum(is_sparse_layer(config, i) for i in range(config.num_hidden_layers))
        return (int(config.num_experts), int(config.num_experts_per_tok),
                int(config.moe_intermediate_size), layers)
