"""Sizing from config alone: the two classic Qwen2.5 examples, and weight bytes checked against
the engine's own layers and transformers' model (both built on the meta device: no memory)."""

from __future__ import annotations

import math

import pytest
import torch
from qwen_configs import QWEN25_7B, QWEN25_72B, write_config

from pagellm.engine_args import EngineArgs
from pagellm.planning.devices import GPU_MEMORY_MIB, MiB
from pagellm.planning.model_spec import ModelSpec
from pagellm.planning.planner import plan_from_args
from pagellm.planning.weights import linear_weight_bytes, num_parameters, weight_bytes_per_rank

H100 = GPU_MEMORY_MIB["h100"][0] * MiB


def _hand_activation(hidden: int, inter: int, tp: int, tokens: int = 2048, seqs: int = 256,
                     vocab: int = 152064, b: int = 2) -> int:
    return max(tokens * (2 * hidden + 4 * inter // tp) * b,
               seqs * vocab * (b + 4) + tokens * hidden * b)


def test_qwen25_7b_fp16_on_one_80gb_gpu(tmp_path):
    model = write_config(tmp_path / "Qwen2.5-7B-Instruct", QWEN25_7B)
    report = plan_from_args(EngineArgs(model=model, dtype="float16", max_model_len=8192), "h100")
    (rank,) = report.ranks
    # Published: 7.61B parameters -> ~15.2 GB (14.2 GiB) in fp16.
    assert 15.1e9 < rank.weights.total < 15.3e9
    assert rank.kv.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    budget = (int(H100 * 0.9) - rank.weights.total - _hand_activation(3584, 18944, 1)
              - 512 * MiB)
    assert rank.kv.kv_budget_bytes == budget
    assert rank.kv.num_blocks == budget // (57344 * 16)
    # Room for 8k contexts at high concurrency: over a million tokens, > 100 requests of 8192.
    assert rank.kv.token_capacity > 1_000_000
    assert rank.kv.max_concurrency > 100
    assert report.fits and rank.status == "fits" and report.suggestions == []


def test_qwen25_72b_fp16_tp2_on_two_80gb_gpus(tmp_path):
    from pagellm.planning.recommend import suggest

    model = write_config(tmp_path / "Qwen2.5-72B-Instruct", QWEN25_72B)
    report = plan_from_args(EngineArgs(model=model, dtype="float16", tensor_parallel_size=2),
                            "h100")
    assert len(report.ranks) == 2
    rank = report.ranks[0]
    # ~72.7B parameters: ~145 GB in fp16, ~72.7 GB per GPU; about 4 GiB of the usable memory left.
    assert 72.0e9 < rank.weights.total < 73.5e9
    assert 3.5 * 2**30 < int(H100 * 0.9) - rank.weights.total < 4.5 * 2**30
    assert rank.kv.kv_bytes_per_token == 2 * 80 * (8 // 2) * 128 * 2
    budget = (int(H100 * 0.9) - rank.weights.total - _hand_activation(8192, 29568, 2)
              - 768 * MiB)
    assert rank.kv.num_blocks == budget // (163840 * 16)
    # The model's own 32k context does not fit: TP=4 or int8 are suggested, each fitting.
    assert rank.kv.max_model_len == 32768 and not report.fits and rank.status == "does not fit"
    fixes = {x.flags: x for x in suggest(report.spec, report.device, report.settings, rank)}
    assert fixes[f"--max-model-len {rank.kv.token_capacity}"].fits
    assert fixes["--tensor-parallel-size 4"].fits
    assert fixes["--tensor-parallel-size 4"].max_concurrency >= 4
    assert fixes["--quantization int8"].fits
    # At 8k it fits, but tightly: fewer than 4 such requests at once.
    short = plan_from_args(EngineArgs(model=model, dtype="float16", tensor_parallel_size=2,
                                      max_model_len=8192), "h100")
    assert short.fits and short.ranks[0].status == "tight"


def _spec(config: dict) -> ModelSpec:
    from transformers import Qwen2Config

    return ModelSpec.from_hf_config(Qwen2Config(**config), "qwen")


@pytest.mark.parametrize(("config", "tp"), [
    (QWEN25_7B, 1), (QWEN25_7B, 2), (QWEN25_72B, 2), (QWEN25_72B, 8),
    # KV heads replicated (1 KV head, 2 ranks), uneven vocabulary split, tied embeddings.
    (dict(QWEN25_7B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=1, vocab_size=401,
          tie_word_embeddings=True), 2),
])
def test_weight_bytes_equal_the_engine_layers(monkeypatch, config, tp):
    """The engine's Qwen2 model, built for one rank of `tp` on the meta device, holds exactly the
    bytes the planner counts."""
    from transformers import Qwen2Config

    from pagellm.distributed import parallel_state
    from pagellm.models.qwen2 import Qwen2ForCausalLM
    from pagellm.models.weight_utils import default_dtype

    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)
    with default_dtype(torch.float16), torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    measured = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes_per_rank(_spec(config), 2, tp).total == measured


@pytest.mark.parametrize("config", [QWEN25_7B, QWEN25_72B])
def test_parameter_count_equals_transformers(config):
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config))
    assert num_parameters(_spec(config)) == sum(p.numel() for p in model.parameters())


def test_quantized_weight_bytes_by_hand():
    assert linear_weight_bytes(4096, 4096, 2, "int8") == 4096 * 4096 + 4096 * 2
    assert linear_weight_bytes(4096, 4096, 2, "int4") == 4096 * 4096 // 2 + 4096 * 128 * 2 * 2
    assert linear_weight_bytes(10, 130, 2, "int4") == 650 + 10 * 5 * 2 * 2  # 5 groups of <= 32
    spec = _spec(QWEN25_7B)
    h, i, layers = 3584, 18944, 28
    # (out, in) of the q/k/v, o, gate/up and down weights of one layer.
    shapes = [(3584 + 2 * 512, h), (h, 3584), (2 * i, h), (h, i)]
    kept = 2 * 152064 * h * 2 + layers * (3584 + 2 * 512) * 2 + (2 * layers + 1) * h * 2
    int8 = kept + layers * sum(o * n + 2 * o for o, n in shapes)
    int4 = kept + layers * sum(o * n // 2 + 2 * 2 * o * math.ceil(n / 32) for o, n in shapes)
    assert weight_bytes_per_rank(spec, 2, 1, "int8").total == int8
    assert weight_bytes_per_rank(spec, 2, 1, "int4").total == int4
    with pytest.raises(ValueError, match="--quantization"):
        weight_bytes_per_rank(spec, 2, 1, "fp8")


def test_tensor_parallel_must_divide_heads(tmp_path):
    model = write_config(tmp_path / "q7", QWEN25_7B)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 cannot split this model"):
        plan_from_args(EngineArgs(model=model, tensor_parallel_size=3), "h100")
