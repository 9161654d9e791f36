"""--generation-config: which generation_config.json is read, its EOS ids and its defaults."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagellm.engine_args import EngineArgs
from pagellm.models.generation_config import (
    GenerationConfig,
    extra_stop_ids,
    load_generation_config,
)
from pagellm.models.loader import ModelSource
from pagellm.sampling_params import SamplingParams

HF_CONFIG = SimpleNamespace(vocab_size=400, eos_token_id=2)


def write_json(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


def hf_source(folder: Path) -> ModelSource:
    return ModelSource(path=str(folder), kind="hf")


def test_auto_reads_eos_list_and_defaults(tmp_path, caplog) -> None:
    write_json(tmp_path, {"eos_token_id": [128, 2, 7], "temperature": 0.6, "top_p": 0.9,
                          "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                          "do_sample": True, "max_new_tokens": 99})
    with caplog.at_level(logging.INFO, logger="pagellm"):
        gen = load_generation_config("auto", hf_source(tmp_path), HF_CONFIG)
    assert gen.eos_token_ids == (128, 2, 7)
    assert gen.defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                            "repetition_penalty": 1.1}
    assert "temperature=0.6" in caplog.text  # logged at start-up, as vLLM does
    params = gen.default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)


def test_vllm_ignores_defaults_but_keeps_eos(tmp_path) -> None:
    write_json(tmp_path, {"eos_token_id": 9, "temperature": 0.6})
    gen = load_generation_config("vllm", hf_source(tmp_path), HF_CONFIG)
    assert gen.defaults == {} and gen.eos_token_ids == (9, 2)
    assert gen.default_sampling_params() == SamplingParams()


def test_config_json_eos_list_without_file(tmp_path) -> None:
    cfg = SimpleNamespace(vocab_size=400, eos_token_id=[2, 300, 5000])  # 5000: out of vocab
    gen = load_generation_config("auto", hf_source(tmp_path), cfg)
    assert gen.path is None and gen.defaults == {} and gen.eos_token_ids == (2, 300)


def test_folder_path_is_read_instead(tmp_path) -> None:
    write_json(tmp_path / "model", {"temperature": 0.6})
    other = write_json(tmp_path / "other", {"temperature": 0.2, "eos_token_id": [3]})
    gen = load_generation_config(str(other), hf_source(tmp_path / "model"), HF_CONFIG)
    assert gen.defaults == {"temperature": 0.2} and gen.eos_token_ids == (3, 2)


@pytest.mark.parametrize("bad", ["missing", "empty", "file"])
def test_bad_path_is_a_clear_error(tmp_path, bad) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("{}")
    with pytest.raises(ValueError, match="--generation-config must be auto, vllm, or a folder"):
        load_generation_config(str(tmp_path / bad), hf_source(tmp_path), HF_CONFIG)


def test_bad_path_through_engine_args(tiny_llama_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="--generation-config"):
        EngineArgs(model=str(tiny_llama_dir), device="cpu",
                   generation_config=str(tmp_path / "nope")).create_engine_config()


def test_unreadable_file_and_invalid_values(tmp_path, caplog) -> None:
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="--generation-config"):
        load_generation_config("auto", hf_source(tmp_path), HF_CONFIG)
    write_json(tmp_path, {"temperature": -1, "top_p": 0.5, "top_k": 1.5})
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        gen = load_generation_config("auto", hf_source(tmp_path), HF_CONFIG)
    assert gen.defaults == {"top_p": 0.5}  # the model still serves; the log says what was left
    assert "temperature" in caplog.text and "top_k" in caplog.text


def test_gguf_without_generation_config(tmp_path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    src = ModelSource(path=str(tmp_path), kind="gguf", gguf_file="m.gguf")
    gen = load_generation_config("auto", src, HF_CONFIG)  # GGUF metadata's EOS: config.json
    assert gen == GenerationConfig(path=None, eos_token_ids=(2,), defaults={})


def test_extra_stop_ids() -> None:
    gen = GenerationConfig(eos_token_ids=(2, 7, 9))
    params = SamplingParams(stop_token_ids=[9, 4])
    out = extra_stop_ids(params, gen, eos_token_id=2)
    assert out.stop_token_ids == [9, 4, 7] and params.stop_token_ids == [9, 4]  # a copy
    assert extra_stop_ids(SamplingParams(ignore_eos=True), gen, 2).stop_token_ids == []
    assert extra_stop_ids(params, None, 2) is params
    assert extra_stop_ids(params, GenerationConfig(eos_token_ids=(2,)), 2) is params


def test_flag_default_and_parse() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).generation_config == "auto"
    ns = parser.parse_args(["--generation-config", "/some/folder"])
    assert EngineArgs.from_cli_args(ns).generation_config == "/some/folder"


def test_gguf_converted_folder_is_read(tmp_path, monkeypatch) -> None:
    from pagellm.models import gguf_cache

    (tmp_path / "m.gguf").write_bytes(b"")
    converted = write_json(tmp_path / "converted", {"eos_token_id": [2, 8], "top_p": 0.8})
    monkeypatch.setattr(gguf_cache, "cached_folder", lambda path, part: str(converted))
    src = ModelSource(path=str(tmp_path), kind="gguf", gguf_file="m.gguf")
    gen = load_generation_config("auto", src, HF_CONFIG)
    assert gen.eos_token_ids == (2, 8) and gen.defaults == {"top_p": 0.8}
