"""Hugging Face architecture name -> pagellm model class."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# architecture -> (module under pagellm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granite_hybrid", "GraniteMoeHybridForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
    # Served text-only (their language model; load_hf_config keeps its config).
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3_5ForCausalLM"),
}

# Image-text checkpoints whose language model is served alone (images are refused).
TEXT_ONLY_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration",
                           "Qwen3_5MoeForConditionalGeneration")

# Configs read from GGUF files carry a model_type but no `architectures`.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_cls(config: Any) -> type[nn.Module]:
    """The class implementing ``config.architectures`` (or its ``model_type`` when absent)."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        model_type = getattr(config, "model_type", None)
        if model_type in _MODEL_TYPES:
            archs = [_MODEL_TYPES[model_type]]
        else:
            archs = [f"model_type={model_type!r}"]
    for arch in archs:
        if arch in _MODELS:
            module_name, cls_name = _MODELS[arch]
            module = importlib.import_module(f"pagellm.models.{module_name}")
            return getattr(module, cls_name)
    raise ValueError(
        f"model architecture {', '.join(archs)} is not supported; supported architectures: "
        f"{', '.join(supported_architectures())}"
    )
