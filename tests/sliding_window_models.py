"""Tiny random-weight checkpoints with sliding-window attention (Mistral, Qwen2 with
max_window_layers, Gemma 2, Gemma 3 text), shared by the model and end-to-end tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from tiny_tokenizer import build_test_tokenizer

WINDOW = 16
SLIDING_ARCHS = ("mistral", "qwen2", "gemma2", "gemma3")


def _root_conftest() -> Any:
    """tests/conftest.py (its tokenizer and tiny configs): by path, as a test directory's own
    conftest (tests/e2e) takes the name ``conftest``."""
    path = str(Path(__file__).with_name("conftest.py"))
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == path:
            return module
    spec = importlib.util.spec_from_file_location("_pagellm_tests_conftest", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[spec.name] = module
    return module


def tiny_config(arch: str, **overrides: Any) -> Any:
    return _root_conftest().tiny_config(arch, **overrides)


def _gemma_common(**overrides: Any) -> dict[str, Any]:
    tok = build_test_tokenizer()
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.25,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, sliding_window=WINDOW,
               query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh")
    cfg.update(overrides)
    return cfg


def sliding_config(arch: str, **overrides: Any) -> Any:
    if arch == "mistral":
        return tiny_config("mistral", sliding_window=WINDOW, **overrides)
    if arch == "qwen2":
        return tiny_config("qwen2", num_hidden_layers=3, use_sliding_window=True,
                           sliding_window=WINDOW, max_window_layers=1, **overrides)
    if arch == "gemma2":
        from transformers import Gemma2Config

        # Untied (tiny tied random models repeat one token; Gemma 3 below covers the tied head).
        return Gemma2Config(**{"tie_word_embeddings": False, **_gemma_common(**overrides)},
                            attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **_gemma_common(**dict(dict(initializer_range=0.05), **overrides)),
            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                         "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                   "rope_theta": 1000000.0}})
    raise ValueError(f"unknown sliding-window arch {arch!r}; one of {SLIDING_ARCHS}")


def write_sliding_model(path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight float32 checkpoint of ``arch`` and the test tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(sliding_config(arch, **overrides),
                                             dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma scales by 1 + w: both kinds get varied weights
                if arch.startswith("gemma"):
                    p.uniform_(-0.5, 0.5)
                else:
                    p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    build_test_tokenizer().save_pretrained(path)
    return path
