"""Mixtral: Mistral's attention with a sparse MoE block (``block_sparse_moe``) in every layer.

Its router always renormalizes the top-k weights; the experts' ``w1``/``w3``/``w2`` tensors go
into FusedMoE's stacked weights (pagellm/layers/fused_moe.py, loading: moe.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagellm.layers.fused_moe import SparseMoeBlock
from pagellm.models.moe import MoeWeightsMixin


class MixtralForCausalLM(MoeWeightsMixin):
    moe_block_name = "block_sparse_moe"
    expert_proj_names = ("w1", "w3", "w2")

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module | None:
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        return SparseMoeBlock(config.num_local_experts, config.num_experts_per_tok,
                              config.hidden_size, config.intermediate_size, renormalize=True)

    @staticmethod
    def moe_layout(config: Any) -> tuple[int, int, int, int]:
        """(experts, top-k, expert width, MoE layers), read by pagellm plan."""
        return (int(config.num_local_experts), int(config.num_experts_per_tok),
                int(config.intermediate_size), int(config.num_hidden_layers))
