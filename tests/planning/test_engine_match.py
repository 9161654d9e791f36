"""The planner against the real engine: the default model (SmolLM2-135M GGUF) on CPU."""

from __future__ import annotations

import json
import logging
import re

from pagellm.entrypoints.cli import main

FLAGS = ["--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--device", "cpu"]


def test_plan_equals_what_the_engine_allocates(capsys, caplog):
    from pagellm.engine.core import EngineCore
    from pagellm.engine_args import EngineArgs

    assert main(["plan", *FLAGS, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    config = EngineArgs(kv_cache_memory="256MiB", max_model_len=2048,
                        device="cpu").create_engine_config()
    with caplog.at_level(logging.INFO, logger="pagellm"):
        core = EngineCore(config)
    runner = core.executor.runner
    rank = plan["ranks"][0]
    assert plan["settings"]["dtype"] == str(config.model.dtype).removeprefix("torch.")
    assert rank["num_blocks"] == core.num_blocks == runner.kv_plan.num_blocks
    assert rank["token_capacity"] == runner.kv_plan.token_capacity
    assert rank["kv_bytes_per_token"] == runner.kv_plan.kv_bytes_per_token
    assert rank["kv_budget_bytes"] == 256 * 2**20
    assert rank["weight_bytes"] == runner.weight_bytes  # weights as loaded (dequantized)
    assert rank["max_concurrency"] == round(runner.kv_plan.max_concurrency, 3)
    assert rank["fits"] and plan["fits"]

    # The start-up log shows the same table, planned beside measured.
    (record,) = [r for r in caplog.records if "vs measured" in r.getMessage()]
    table = record.getMessage()
    blocks = re.search(r"blocks of 16 tokens\s+([\d,]+)\s+([\d,]+)", table)
    assert blocks is not None
    assert blocks.group(1) == blocks.group(2) == f"{core.num_blocks:,}"
    weights = re.search(r"weights\s+([\d.]+ \w+)\s+([\d.]+ \w+)", table)
    assert weights is not None and weights.group(1) == weights.group(2)

    # The spec read from the GGUF header is the one the engine built from transformers' config.
    from pagellm.planning.model_spec import ModelSpec, load_model_spec

    from_header, _ = load_model_spec(None)
    from_engine = ModelSpec.from_hf_config(config.model.hf_config, from_header.name,
                                           from_header.checkpoint_format,
                                           from_header.checkpoint_bytes)
    assert from_header == from_engine


def test_gguf_header_reader_matches_gguf_reader():
    from gguf import GGUFReader

    from pagellm.models.loader import default_model_path
    from pagellm.planning.model_spec import read_gguf_header

    path = default_model_path()
    meta, tensors = read_gguf_header(path)
    reader = GGUFReader(path)
    assert len(tensors) == len(reader.tensors)
    for t in reader.tensors:
        mine = tensors[t.name]
        assert mine.n_bytes == int(t.n_bytes)
        assert mine.dims == tuple(int(d) for d in t.shape)
        assert mine.type_name == t.tensor_type.name
    for key in ("llama.block_count", "llama.embedding_length", "llama.attention.head_count",
                "llama.attention.head_count_kv", "llama.context_length", "general.architecture"):
        field = reader.fields[key]
        value = field.contents() if hasattr(field, "contents") else field.parts[field.data[0]][0]
        assert meta[key] == value
    assert meta["tokenizer.ggml.tokens"].array_len == len(reader.fields["tokenizer.ggml.tokens"]
                                                          .data)


def test_plan_counts_a_draft_model(tiny_llama_dir, make_tiny_model, tmp_path, capsys):
    """Speculative decoding with a draft model: the plan adds the draft's weights and its
    cache's bytes per token, as the engine does (both caches share one budget)."""
    from pagellm.engine.core import EngineCore
    from pagellm.engine_args import EngineArgs

    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    kw = {"kv_cache_memory": "16MiB", "max_model_len": 256, "dtype": "float32"}
    flags = [str(tiny_llama_dir), "--kv-cache-memory", "16MiB", "--max-model-len", "256",
             "--dtype", "float32", "--device", "cpu", "--json"]
    plans = []
    for extra in ([], ["--speculative-config", json.dumps(spec)]):
        assert main(["plan", *flags, *extra]) == 0
        plans.append(json.loads(capsys.readouterr().out)["ranks"][0])
    alone, with_draft = plans
    core = EngineCore(EngineArgs(model=str(tiny_llama_dir), speculative_config=spec,
                                 **kw).create_engine_config())
    runner = core.executor.runner
    proposer = runner.spec_decode.proposer
    assert with_draft["draft_weight_bytes"] == proposer.weight_bytes > 0
    assert with_draft["weight_bytes"] == alone["weight_bytes"] == runner.weight_bytes
    assert with_draft["draft_kv_bytes_per_token"] == proposer.kv_bytes_per_token > 0
    assert with_draft["kv_bytes_per_token"] == runner.kv_plan.kv_bytes_per_token == (
        alone["kv_bytes_per_token"] + proposer.kv_bytes_per_token)
    assert with_draft["num_blocks"] == core.num_blocks < alone["num_blocks"]
    core.shutdown()
    # The table names the draft's share.
    assert main(["plan", *flags[:-1], "--speculative-config", json.dumps(spec)]) == 0
    table = capsys.readouterr().out
    assert "draft model (speculative decoding)" in table and "of which the draft model" in table
