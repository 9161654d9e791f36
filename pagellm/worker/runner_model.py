"""A model as a runner runs it: loaded, its attention layers bound to the engine's backend and
KV cache groups, its linears in the layouts the CPU kernels read (the target model in
model_runner.py, a draft model in spec_decode/draft_model.py)."""

from __future__ import annotations

import torch

from pagellm.attention.backend import Workspace
from pagellm.config import ModelConfig
from pagellm.core.kv_cache_groups import KVCacheLayout
from pagellm.layers.attention import Attention
from pagellm.layers.fused_moe import prepack_experts_for_cpu
from pagellm.layers.linear import prepack_linears_for_cpu
from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward


def load_runner_model(model_config: ModelConfig, device: torch.device, attention_backend: str,
                      layout: KVCacheLayout) -> torch.nn.Module:
    """The model from its checkpoint, in the layouts the kernels read."""
    from pagellm.models.loader import build_model

    m = model_config
    model = build_model(m.hf_config, m.source, m.dtype, device, m.load_format, m.quantization,
                        m.max_model_len)
    model.eval()
    # Before the fused CPU path, which asks the layers for their backend.
    bind_attention_backends(model, attention_backend, device)
    assign_kv_cache_groups(model, layout)
    prepack_linears_for_cpu(model)
    prepack_experts_for_cpu(model)
    enable_fused_cpu_forward(model)
    return model


def bind_attention_backends(model: torch.nn.Module, backend_name: str,
                            device: torch.device) -> None:
    """Name this engine's backend on every attention layer of ``model`` that names none (the
    process-wide default belongs to no engine), build the backends, and give them all one
    scratch workspace: the layers run one after another."""
    workspace: Workspace = {}
    for module in model.modules():
        if isinstance(module, Attention):
            if module.backend_name is None:
                module.backend_name = backend_name
            module.get_backend(device).workspace = workspace


def assign_kv_cache_groups(model: torch.nn.Module, layout: KVCacheLayout) -> None:
    """Tell every attention layer which KV cache group's block tables it reads; its window
    must be its group's (the scheduler frees blocks by the group's window)."""
    for module in model.modules():
        if isinstance(module, Attention):
            group = layout.group_of_layer[module.layer_idx]
            if module.sliding_window != layout.groups[group].sliding_window:
                raise ValueError(f"layer {module.layer_idx}: sliding window "
                                 f"{module.sliding_window} differs from its KV cache group's "
                                 f"({layout.groups[group].sliding_window})")
            module.kv_cache_group = group
