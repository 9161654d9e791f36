"""Phi-3 GGUF files, written the way llama.cpp's convert_hf_to_gguf.py (Phi3MiniModel) lays
them out: fused ``attn_qkv``, ``ffn_up`` holding gate then up, no ``ffn_gate``; longrope's factors
as the tensors ``rope_factors_long/short`` with ``phi3.rope.scaling.original_context_length``;
``phi3.rope.dimension_count`` for the rotary width; a gpt2 token list (transformers takes the
vocabulary size from it). Float32 tensors, so the GGUF load must equal the safetensors one."""

from __future__ import annotations

from pathlib import Path

import hf_compare
import numpy as np
import pytest
import torch
from gguf_checks import (
    assert_hf_greedy,
    assert_same_paged_logits,
    assert_same_weights,
    finish_gguf,
)

from pagellm.layers.rotary import get_rope_parameters
from pagellm.models.gguf_loader import gguf_to_hf_name
from pagellm.models.loader import load_hf_config, resolve_model_source

# HF name -> GGUF name (gguf.constants TENSOR_NAMES for MODEL_ARCH.PHI3).
_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
            "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
            "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
            "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_phi3_gguf(hf_dir: Path, out: Path, tokenizer) -> Path:
    from gguf import GGUFWriter
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    rope = get_rope_parameters(c)
    head_dim = c.hidden_size // c.num_attention_heads
    w = GGUFWriter(str(out), "phi3")
    w.add_context_length(c.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * head_dim))
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.sliding_window or 0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    for name, t in load_file(hf_dir / "model.safetensors").items():
        stem, _, suffix = name.rpartition(".")
        if stem in _TO_GGUF:
            gguf_name = f"{_TO_GGUF[stem]}.{suffix}"
        else:
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{_TO_GGUF[rest]}.{suffix}"
        w.add_tensor(gguf_name, np.ascontiguousarray(t.numpy()))
    if rope["rope_type"] == "longrope":
        w.add_rope_scaling_attn_factors(1.0)  # llama.cpp's; the config derives it
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight",
                         np.array(rope[f"{kind}_factor"], dtype=np.float32))
    finish_gguf(w)
    return out


def _hf_dir(case: str, tmp_path: Path, tiny_model_dir, make_tiny_model) -> Path:
    if case == "longrope":
        return tiny_model_dir("phi3")
    if case == "default":  # Phi-3-mini-4k: no rope scaling
        return make_tiny_model(tmp_path / "hf", "phi3", rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0})
    half = 16 // 2 // 2  # Phi-4-mini: longrope over half of each head, tied embeddings
    return make_tiny_model(tmp_path / "hf", "phi3", tie_word_embeddings=True, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 1.5 * i for i in range(half)]})


@pytest.mark.parametrize("case", ["longrope", "default", "partial-tied"])
def test_phi3_gguf_matches_safetensors_and_transformers(case, tmp_path, monkeypatch,
                                                        tiny_model_dir, make_tiny_model,
                                                        tiny_tokenizer):

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = _hf_dir(case, tmp_path, tiny_model_dir, make_tiny_model)
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    gguf = write_phi3_gguf(hf_dir, gguf_dir / "phi3.gguf", tiny_tokenizer)

    hf_config = load_hf_config(resolve_model_source(str(hf_dir)))
    for _ in range(2):  # converted by transformers + us, then read back from the cache
        config = load_hf_config(resolve_model_source(str(gguf)))
        assert config.architectures == ["Phi3ForCausalLM"]
        assert config.original_max_position_embeddings == hf_config.original_max_position_embeddings
        assert config.tie_word_embeddings == hf_config.tie_word_embeddings
        got, want = get_rope_parameters(config), get_rope_parameters(hf_config)
        assert got["rope_type"] == want["rope_type"]
        assert ("long_factor" in got) == ("long_factor" in want)
        for key in ("rope_theta", "partial_rotary_factor", "long_factor", "short_factor"):
            if key in want:  # GGUF keeps float32: compare as such
                assert torch.equal(torch.tensor(got[key], dtype=torch.float32),
                                   torch.tensor(want[key], dtype=torch.float32)), key

    ours, reference = hf_compare.ours(gguf), hf_compare.ours(hf_dir)
    assert_same_weights(ours, reference)  # fused tensors split as from safetensors
    ids = tiny_tokenizer(hf_compare.PROMPT).input_ids
    # Bit for bit: rms_norm_eps and the rope factors, stored as float32, are used as float32.
    assert_same_paged_logits(ours, reference, ids)

    hf = hf_compare.reference(hf_dir)
    assert_hf_greedy(ours, hf, ids)


def test_phi3_gguf_tensor_names():
    assert gguf_to_hf_name("blk.1.attn_qkv.weight", "phi3") == \
        "model.layers.1.self_attn.qkv_proj.weight"
    assert gguf_to_hf_name("blk.1.ffn_up.weight", "phi3") == \
        "model.layers.1.mlp.gate_up_proj.weight"
    assert gguf_to_hf_name("blk.1.ffn_up.weight", "llama") == "model.layers.1.mlp.up_proj.weight"
    assert gguf_to_hf_name("rope_factors_long.weight", "phi3") is None
    with pytest.raises(ValueError, match="'blk.0.attn_qkv.weight' of a 'llama' file"):
        gguf_to_hf_name("blk.0.attn_qkv.weight", "llama")
