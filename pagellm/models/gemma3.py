"""Gemma 3 text models (``Gemma3ForCausalLM``): Gemma 2's layers with a Gemma RMSNorm over each
head of q and k, no soft-capping by default, and two rotary tables: global layers use the
``full_attention`` rope settings (theta 1e6, maybe linear scaling), sliding layers the
``sliding_attention`` ones (``rope_local_base_freq``, 10k). Sliding layers follow
``layer_types`` (``sliding_window_pattern``: 5 local, then 1 global)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pagellm.layers.rotary import RotaryEmbedding, get_rope
from pagellm.models.gemma2 import Gemma2ForCausalLM, gemma_layer_types
from pagellm.models.llama import get_head_dim, rope_table_len


def gemma3_rope_parameters(config: Any, layer_type: str) -> dict[str, Any]:
    """The rope settings of one layer type: transformers 5 keeps one dict per type; older
    configs have ``rope_theta`` (+ ``rope_scaling``) for global layers and
    ``rope_local_base_freq`` for sliding ones."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        return dict(params[layer_type])
    if layer_type == "sliding_attention":
        return {"rope_type": "default",
                "rope_theta": getattr(config, "rope_local_base_freq", None) or 10000.0}
    out = dict(getattr(config, "rope_scaling", None) or {})
    out.setdefault("rope_type", out.pop("type", "default"))
    out["rope_theta"] = getattr(config, "rope_theta", None) or 1_000_000.0
    return out


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
    sliding_window_pattern = 6

    def make_ropes(self, config: Any, max_model_len: int | None) -> list[RotaryEmbedding]:
        rows = rope_table_len(config, max_model_len)
        tables: dict[str, RotaryEmbedding] = {}
        ropes = []
        for layer_type in gemma_layer_types(config, self.sliding_window_pattern):
            if layer_type not in tables:
                view = SimpleNamespace(
                    rope_parameters=gemma3_rope_parameters(config, layer_type),
                    max_position_embeddings=config.max_position_embeddings)
                tables[layer_type] = get_rope(get_head_dim(config), rows, view, max_model_len)
            ropes.append(tables[layer_type])
        return ropes
