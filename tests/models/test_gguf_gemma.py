"""Gemma 2 and Gemma 3 (text) GGUF files, written the way llama.cpp's convert_hf_to_gguf.py
(Gemma2Model, Gemma3Model) lays them out: every ``*norm.weight`` stored as 1 + w, Gemma's
four norms per layer (``attn_norm``, ``post_attention_norm``, ``ffn_norm`` = the pre-feedforward
norm, ``post_ffw_norm``), Gemma 2 without ``output`` (tied head), key/value lengths, the
soft-capping values, the window; Gemma 3 with its global rope base, linear scaling and, as the
gguf writer records it, the local rope base and the per-layer sliding pattern. Float32 tensors;
the norm weights are multiples of 2**-8, so 1 + w is exact and the GGUF load must equal the
safetensors one bit for bit; greedy tokens match transformers."""

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
from sliding_window_models import write_sliding_model

from pagellm.models.gguf_gemma import gemma_layer_types
from pagellm.models.gguf_loader import gguf_to_hf_name
from pagellm.models.loader import load_hf_config, resolve_model_source
from pagellm.planning.model_spec import gguf_model_spec
from pagellm.planning.weights import num_parameters

# HF name -> GGUF name (gguf.tensor_mapping for MODEL_ARCH.GEMMA2 / GEMMA3).
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "post_attention_layernorm": "post_attention_norm",
          "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gemma_gguf(hf_dir: Path, out: Path, tokenizer) -> Path:
    from gguf import GGUFWriter, RopeScalingType
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    arch = "gemma2" if c.model_type == "gemma2" else "gemma3"
    w = GGUFWriter(str(out), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if arch == "gemma2" and name == "lm_head.weight":
            continue  # the converter drops it: llama.cpp's Gemma 2 always ties its head
        if name.endswith("norm.weight"):
            t = t + 1  # "norm weights + 1"
        stem, _, suffix = name.rpartition(".")
        if stem in _GLOBAL:
            gguf_name = f"{_GLOBAL[stem]}.{suffix}"
        else:
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{_BLOCK[rest]}.{suffix}"
        w.add_tensor(gguf_name, np.ascontiguousarray(t.numpy()))
    finish_gguf(w)
    return out


def _hf_dir(arch: str, path: Path) -> Path:
    """The tiny checkpoint with llama.cpp's attention scale (head_dim ** -0.5: the files carry
    no query_pre_attn_scalar) and norm weights rounded to multiples of 2**-8."""
    from safetensors.torch import load_file, save_file

    overrides: dict[str, object] = {"query_pre_attn_scalar": 16}
    if arch == "gemma2":
        # As every Gemma 2 (see write_gemma_gguf); smaller weights keep the tied tiny model
        # from repeating one token.
        overrides.update(tie_word_embeddings=True, initializer_range=0.05)
    write_sliding_model(path, arch, **overrides)
    file = path / "model.safetensors"
    state = load_file(file)
    for name, t in state.items():
        if name.endswith("norm.weight"):
            state[name] = torch.round(t * 256) / 256
    save_file(state, file, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_safetensors_and_transformers(arch, tmp_path, monkeypatch,
                                                         tiny_tokenizer):

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = _hf_dir(arch, tmp_path / "hf")
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    gguf = write_gemma_gguf(hf_dir, gguf_dir / f"{arch}.gguf", tiny_tokenizer)

    hf_config = load_hf_config(resolve_model_source(str(hf_dir)))
    for _ in range(2):  # converted by transformers + us, then read back from the cache
        config = load_hf_config(resolve_model_source(str(gguf)))
        assert config.architectures == hf_config.architectures
        for key in ("head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar",
                    "tie_word_embeddings", "num_key_value_heads", "max_position_embeddings",
                    "hidden_activation"):
            assert getattr(config, key) == getattr(hf_config, key), key
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "rms_norm_eps"):
            got, want = getattr(config, key), getattr(hf_config, key)
            assert (got is None) == (want is None), key
            if want is not None:  # GGUF keeps float32
                assert np.float32(got) == np.float32(want), key
        assert config.rope_parameters == hf_config.rope_parameters

    ours, reference = hf_compare.ours(gguf), hf_compare.ours(hf_dir)
    assert_same_weights(ours, reference)  # norms back to w, as in the checkpoint
    ids = tiny_tokenizer(hf_compare.PROMPT).input_ids
    assert_same_paged_logits(ours, reference, ids)

    hf = hf_compare.reference(hf_dir)
    spec = gguf_model_spec(str(gguf))  # pagellm plan: windows per layer, parameter count
    assert spec.engine_supported
    assert spec.layer_windows == tuple(ours.layer_windows)
    assert num_parameters(spec) == sum(p.numel() for p in hf.parameters())
    assert_hf_greedy(ours, hf, ids)


@pytest.mark.parametrize("arch,layers", [("gemma2", 26), ("gemma3", 26), ("gemma3", 62)])
def test_default_layer_types_match_transformers(arch, layers):
    """Files without ``sliding_window_pattern`` (llama.cpp's converter writes none): llama.cpp's
    fixed periods, as the checkpoints' configs default them."""
    from transformers import Gemma2Config, Gemma3TextConfig

    cls = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
    assert gemma_layer_types(arch, layers, 512, None) == cls(num_hidden_layers=layers).layer_types
    assert gemma_layer_types(arch, layers, None, None) == ["full_attention"] * layers
    with pytest.raises(ValueError, match="sliding_window_pattern has 3 entries for 26 layers"):
        gemma_layer_types(arch, 26, 512, [True, False, True])


def test_gemma_gguf_tensor_names():
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "gemma2") == \
        "model.layers.2.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.post_attention_norm.weight", "gemma3") == \
        "model.layers.2.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.post_ffw_norm.weight", "gemma3") == \
        "model.layers.2.post_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.2.ffn_norm.weight", "llama") == \
        "model.layers.2.post_attention_layernorm.weight"
