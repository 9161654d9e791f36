"""`pagellm plan` on sliding-window models: KV bytes of a block count the layers a block holds
(one KV cache group's), a max_model_len request holds the full group's length plus the windowed
group's window, and the report shows the saving; Gemma-2-2B's published config, no download."""

from __future__ import annotations

import json

import torch
from qwen_configs import write_config

from pagellm.entrypoints.cli import main
from pagellm.planning.model_spec import ModelSpec
from pagellm.planning.weights import num_parameters

GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000,
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "attention_bias": False,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


def test_gemma2_plan_counts_window_sized_kv(tmp_path, capsys):
    model = write_config(tmp_path / "gemma-2-2b", GEMMA2_2B)
    args = ["plan", model, "--dtype", "bfloat16", "--device", "h100", "--max-model-len", "8192",
            "--max-num-batched-tokens", "512"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["architecture"] == "Gemma2ForCausalLM"
    assert out["model"]["layer_windows"] == [4096, None] * 13
    rank = out["ranks"][0]
    # A block holds 13 layers (one group of the two): 2 x 13 x 4 heads x 256 x 2 bytes.
    assert rank["kv_bytes_per_token"] == 2 * 13 * 4 * 256 * 2
    # Full group: 512 blocks; sliding group: ceil((4095 + 512) / 16) + 1 = 289 blocks.
    assert rank["request_kv_bytes"] == (512 + 289) * 16 * rank["kv_bytes_per_token"]
    assert rank["request_kv_bytes_full_attention"] == 8192 * 2 * 26 * 4 * 256 * 2
    assert 0.2 < rank["sliding_window_saving"] < 0.25
    assert rank["max_concurrency"] == round(rank["num_blocks"] / (512 + 289), 3)
    assert main(args) == 0
    assert "if no layer slid (saving" in capsys.readouterr().out


def test_full_attention_plan_shows_no_saving(tmp_path, capsys):
    llama = dict(GEMMA2_2B, architectures=["LlamaForCausalLM"], model_type="llama",
                 hidden_act="silu", sliding_window=None)
    model = write_config(tmp_path / "llama", llama)
    assert main(["plan", model, "--device", "h100", "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["ranks"][0]
    assert rank["sliding_window_saving"] == 0
    assert rank["kv_bytes_per_token"] == 2 * 26 * 4 * 256 * 2


def test_gemma_parameter_count_equals_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM

    for extra in ({}, {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}):
        config = AutoConfig.for_model(**dict(GEMMA2_2B, **extra))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        spec = ModelSpec.from_hf_config(config, "gemma")
        assert num_parameters(spec) == sum(p.numel() for p in model.parameters())
