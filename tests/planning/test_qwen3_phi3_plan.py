"""`pagellm plan` on Qwen3 and Phi-3 configs: the architecture is one the engine runs, and the
weight bytes are those of the engine's layers (q/k norms included) and transformers' count."""

from __future__ import annotations

import json

import pytest
import torch
from qwen_configs import write_config

from pagellm.entrypoints.cli import main
from pagellm.planning.model_spec import ModelSpec
from pagellm.planning.weights import num_parameters, weight_bytes_per_rank

# Published config.json values of Qwen/Qwen3-8B and microsoft/Phi-3-mini-4k-instruct.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 151936, "use_sliding_window": False, "sliding_window": None,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
PHI3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "rope_scaling": None, "sliding_window": 2047, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32064, "bos_token_id": 1, "eos_token_id": 32000,
    "pad_token_id": 32000,
}
CONFIGS = {"Qwen3-8B": QWEN3_8B, "Phi-3-mini-4k-instruct": PHI3_MINI_4K}


def _hf_config(config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(**config)


@pytest.mark.parametrize("name", CONFIGS)
def test_plan_accepts_the_architecture(tmp_path, capsys, name):
    model = write_config(tmp_path / name, CONFIGS[name])
    assert main(["plan", model, "--dtype", "bfloat16", "--device", "h100",
                 "--max-model-len", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["architecture"] == CONFIGS[name]["architectures"][0]
    assert out["model"]["engine_supported"] is True
    assert not any("not an architecture the engine runs" in w for w in out["warnings"])
    # Published sizes: Qwen3-8B 8.19B parameters, Phi-3-mini 3.82B.
    expected = {"Qwen3-8B": 8.19e9, "Phi-3-mini-4k-instruct": 3.82e9}[name]
    assert abs(out["model"]["num_parameters"] - expected) < 0.01e9


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_count_equals_transformers(name):
    from transformers import AutoModelForCausalLM

    config = _hf_config(CONFIGS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = ModelSpec.from_hf_config(config, name)
    assert num_parameters(spec) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", CONFIGS)
def test_weight_bytes_equal_the_engine_layers(monkeypatch, name, tp):
    from pagellm.distributed import parallel_state
    from pagellm.models.registry import get_model_cls
    from pagellm.models.weight_utils import default_dtype

    config = _hf_config(CONFIGS[name])
    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)
    with default_dtype(torch.bfloat16), torch.device("meta"):
        model = get_model_cls(config)(config)
    measured = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes_per_rank(ModelSpec.from_hf_config(config, name), 2, tp).total == measured
