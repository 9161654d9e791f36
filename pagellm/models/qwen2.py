"""Qwen2 / Qwen2.5: Llama's layout with a bias on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from pagellm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_bias(config: Any) -> tuple[bool, bool]:
        return True, False

    @staticmethod
    def get_sliding_window(config: Any) -> int | None:
        # Qwen2 configs carry a sliding_window that is only used when use_sliding_window is set.
        if not getattr(config, "use_sliding_window", False):
            return None
        return LlamaForCausalLM.get_sliding_window(config)

    @classmethod
    def layer_sliding_windows(cls, config: Any) -> list[int | None]:
        # Layers from max_window_layers on slide (transformers 5 spells it out in layer_types).
        window = cls.get_sliding_window(config)
        if window is None or getattr(config, "layer_types", None):
            return super().layer_sliding_windows(config)
        first = int(getattr(config, "max_window_layers", 0) or 0)
        return [window if i >= first else None for i in range(int(config.num_hidden_layers))]
