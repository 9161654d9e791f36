"""Mixture-of-Experts GGUF files, written the way llama.cpp's convert_hf_to_gguf.py lays them out:
Mixtral as a "llama" file (Q/K rows permuted, ``llama.expert_count``/``expert_used_count``, the
expert width as ``feed_forward_length``), Qwen3-MoE as a "qwen3moe" file (unpermuted, per-head
q/k norms, ``expert_feed_forward_length``); per layer the router ``ffn_gate_inp`` and the experts
stacked in ``ffn_gate_exps``/``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]``.
Also Mixtral's older layout, one tensor per expert (``blk.N.ffn_gate.E.weight``), in a file
named "mistral" (which transformers reads as a dense Mistral). Float32
tensors, so the GGUF load must equal the safetensors one; greedy tokens match transformers."""

from __future__ import annotations

import re
from pathlib import Path

import hf_compare
import numpy as np
import pytest
from gguf_checks import (
    assert_hf_greedy,
    assert_same_paged_logits,
    assert_same_weights,
    finish_gguf,
)

from pagellm.models.gguf_loader import gguf_expert_names, gguf_to_hf_name
from pagellm.models.loader import load_hf_config, resolve_model_source
from pagellm.planning.model_spec import gguf_model_spec
from pagellm.planning.weights import num_parameters

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# checkpoint projection names of (gate, up, down) and the MoE block's name, per GGUF arch
_MOE = {"llama": ("block_sparse_moe", ("w1", "w3", "w2")),
        "qwen3moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half rope rows -> interleaved."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_moe_gguf(hf_dir: Path, out: Path, tokenizer, per_expert: bool = False) -> Path:
    from gguf import GGUFWriter
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    arch = "llama" if c.model_type == "mixtral" else "qwen3moe"
    block, projs = _MOE[arch]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = GGUFWriter(str(out), arch)
    if per_expert:  # transformers then reads the file as a Mistral: still Mixtral here
        w.add_name("mistral")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_count(c.num_local_experts if arch == "llama" else c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "llama":
        w.add_feed_forward_length(c.intermediate_size)  # Mixtral: the experts' width
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_feed_forward_length(c.intermediate_size)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    state = {n: t.numpy() for n, t in load_file(hf_dir / "model.safetensors").items()}
    expert = re.compile(rf"model\.layers\.(\d+)\.{block}\.experts\.(\d+)\.(\w+)\.weight")
    stacks: dict[tuple[str, int], dict[int, np.ndarray]] = {}
    for name, t in state.items():
        if m := expert.fullmatch(name):
            layer, e, proj = m.group(1), int(m.group(2)), projs.index(m.group(3))
            if per_expert:  # the old layout: blk.N.ffn_gate.E.weight
                kind = ("ffn_gate", "ffn_up", "ffn_down")[proj]
                w.add_tensor(f"blk.{layer}.{kind}.{e}.weight", np.ascontiguousarray(t))
            else:
                stacks.setdefault((layer, proj), {})[e] = t
            continue
        stem, _, suffix = name.rpartition(".")
        if stem in _GLOBAL:
            w.add_tensor(f"{_GLOBAL[stem]}.{suffix}", np.ascontiguousarray(t))
            continue
        _, _, layer, rest = stem.split(".", 3)
        if rest == f"{block}.gate":
            gguf = "ffn_gate_inp"
        else:
            gguf = _BLOCK[rest]
        if arch == "llama" and gguf == "attn_q":
            t = _permute(t, c.num_attention_heads)
        elif arch == "llama" and gguf == "attn_k":
            t = _permute(t, c.num_key_value_heads)
        w.add_tensor(f"blk.{layer}.{gguf}.{suffix}", np.ascontiguousarray(t))
    for (layer, proj), experts in stacks.items():
        stacked = np.stack([experts[e] for e in sorted(experts)])
        w.add_tensor(f"blk.{layer}.{_STACKS[proj]}.weight", stacked)
    finish_gguf(w)
    return out


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _hf_dir(case: str, tmp_path: Path, tiny_model_dir, make_tiny_model) -> Path:
    if case.startswith("mixtral"):
        return tiny_model_dir("mixtral")
    # llama.cpp's qwen3moe has no dense layers and always renormalizes the top-k weights.
    return make_tiny_model(tmp_path / "hf", "qwen3-moe", mlp_only_layers=[],
                           norm_topk_prob=True)


@pytest.mark.parametrize("case", ["mixtral", "mixtral-per-expert", "qwen3-moe"])
def test_moe_gguf_matches_safetensors_and_transformers(case, tmp_path, monkeypatch,
                                                       tiny_model_dir, make_tiny_model,
                                                       tiny_tokenizer):

    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = _hf_dir(case, tmp_path, tiny_model_dir, make_tiny_model)
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    gguf = write_moe_gguf(hf_dir, gguf_dir / "moe.gguf", tiny_tokenizer,
                          per_expert=case.endswith("per-expert"))

    hf_config = load_hf_config(resolve_model_source(str(hf_dir)))
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "num_experts_per_tok", "vocab_size", "tie_word_embeddings")
    keys += (("num_local_experts", "intermediate_size", "sliding_window")
             if case.startswith("mixtral") else
             ("num_experts", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
              "decoder_sparse_step"))
    for attempt in range(2):  # converted by transformers + us, then read back from the cache
        config = load_hf_config(resolve_model_source(str(gguf)))
        assert config.architectures == hf_config.architectures, attempt
        assert _head_dim(config) == _head_dim(hf_config)
        for key in keys:
            assert getattr(config, key, None) == getattr(hf_config, key, None), (key, attempt)

    for attempt in range(2):  # the GGUF's tensors, then the cache's safetensors copy
        ours, reference = hf_compare.ours(gguf), hf_compare.ours(hf_dir)
        assert_same_weights(ours, reference, attempt)  # experts stacked as from safetensors
    ids = tiny_tokenizer(hf_compare.PROMPT).input_ids
    assert_same_paged_logits(ours, reference, ids)

    hf = hf_compare.reference(hf_dir)
    # `pagellm plan` reads only the GGUF header: every expert counted, as transformers does.
    spec = gguf_model_spec(str(gguf))
    assert spec.engine_supported and spec.num_experts == len(ours.model.layers[0].mlp.experts
                                                             .w13_weight)
    assert num_parameters(spec) == sum(p.numel() for p in hf.parameters())
    assert_hf_greedy(ours, hf, ids)


def test_moe_gguf_tensor_names():
    assert gguf_expert_names("blk.2.ffn_down_exps.weight", "llama", 2) == [
        "model.layers.2.block_sparse_moe.experts.0.w2.weight",
        "model.layers.2.block_sparse_moe.experts.1.w2.weight"]
    assert gguf_expert_names("blk.0.ffn_up_exps.weight", "qwen3moe", 1) == [
        "model.layers.0.mlp.experts.0.up_proj.weight"]
    assert gguf_expert_names("blk.0.ffn_up.weight", "llama", 4) is None
    assert gguf_to_hf_name("blk.1.ffn_gate_inp.weight", "qwen3moe") == \
        "model.layers.1.mlp.gate.weight"
    assert gguf_to_hf_name("blk.1.ffn_gate_inp.weight", "llama") == \
        "model.layers.1.block_sparse_moe.gate.weight"
    assert gguf_to_hf_name("blk.1.ffn_gate.7.weight", "llama") == \
        "model.layers.1.block_sparse_moe.experts.7.w1.weight"
    with pytest.raises(ValueError, match="experts in a 'qwen2' file are not supported"):
        gguf_expert_names("blk.0.ffn_gate_exps.weight", "qwen2", 4)
