"""`pagellm plan` on Mixture-of-Experts configs (Mixtral-8x7B, Qwen3-30B-A3B): every expert is
counted, in the parameter count (against transformers' model) and in each rank's weight bytes
(against the engine's layers, experts split over tp along their intermediate dimension)."""

from __future__ import annotations

import json

import pytest
import torch
from qwen_configs import write_config

from pagellm.entrypoints.cli import main
from pagellm.planning.model_spec import ModelSpec
from pagellm.planning.weights import num_parameters, weight_bytes_per_rank

# Published config.json values of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B.
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "attention_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
    "use_sliding_window": False, "sliding_window": None, "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# A Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step), small enough to build.
QWEN3_MOE_MIXED = dict(QWEN3_30B_A3B, num_hidden_layers=6, num_experts=16, mlp_only_layers=[0],
                       decoder_sparse_step=2, vocab_size=1000)
CONFIGS = {"Mixtral-8x7B-v0.1": MIXTRAL_8X7B, "Qwen3-30B-A3B": QWEN3_30B_A3B,
           "qwen3-moe-mixed": QWEN3_MOE_MIXED}


def _hf_config(config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(**config)


@pytest.mark.parametrize("name,expected", [("Mixtral-8x7B-v0.1", 46.70e9),
                                           ("Qwen3-30B-A3B", 30.53e9)])
def test_plan_counts_every_expert(tmp_path, capsys, name, expected):
    model = write_config(tmp_path / name, CONFIGS[name])
    assert main(["plan", model, "--dtype", "bfloat16", "--device", "h200",
                 "--max-model-len", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["architecture"] == CONFIGS[name]["architectures"][0]
    assert out["model"]["engine_supported"] is True
    assert abs(out["model"]["num_parameters"] - expected) < 0.01e9


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_count_equals_transformers(name):
    from transformers import AutoModelForCausalLM

    config = _hf_config(CONFIGS[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = ModelSpec.from_hf_config(config, name)
    assert spec.num_experts > 0 and spec.moe_layers > 0
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


# Small enough to build for real: 8 experts of width 64, hidden 128 (every int4 group is 32).
SMALL_MOE = {"Mixtral": dict(MIXTRAL_8X7B, hidden_size=128, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=256),
             "Qwen3-MoE": dict(QWEN3_MOE_MIXED, hidden_size=128, intermediate_size=96,
                               moe_intermediate_size=64, num_hidden_layers=3, head_dim=32,
                               num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                               mlp_only_layers=[1], vocab_size=256)}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", SMALL_MOE)
def test_quantized_weight_bytes_equal_the_engine(name, quantization):
    """The engine quantizes experts too: its bytes (bfloat16, plain-layout "torch" backend with
    16-bit scales) are the plan's, experts and linears alike."""
    from pagellm.layers.quantization import param_bytes, quantize_model
    from pagellm.models.registry import get_model_cls
    from pagellm.models.weight_utils import default_dtype, init_dummy_weights

    config = _hf_config(SMALL_MOE[name])
    with default_dtype(torch.bfloat16):
        model = get_model_cls(config)(config)
    init_dummy_weights(model)
    float_bytes = param_bytes(model)
    spec = ModelSpec.from_hf_config(config, name)
    assert weight_bytes_per_rank(spec, 2).total == float_bytes
    report = quantize_model(model, quantization, "torch")
    assert not report.skipped
    assert weight_bytes_per_rank(spec, 2, 1, quantization).total == param_bytes(model)
