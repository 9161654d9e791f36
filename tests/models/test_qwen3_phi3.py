"""Qwen3 (per-head q/k RMSNorm) and Phi-3 (fused qkv/gate_up tensors, longrope) beyond the shared
tiny-model tests: both attention backends against transformers (the MoE families too), Qwen3
refused by the fused CPU step (its module path, with the CPU kernels, still matches
transformers), longrope's cos/sin tables and its static short/long choice, partial rotary with
tied embeddings (Phi-4-mini's layout), Qwen3 GGUF tensors, and the registry's error for other
architectures."""

from __future__ import annotations

import pytest
import torch
from hf_compare import NUM_NEW, PROMPT, check_against_hf, hf_tokens_and_logits, ours, reference
from paged_harness import PagedHarness

from pagellm.attention import registry
from pagellm.forward_context import set_forward_context
from pagellm.kernels import cpu_ops
from pagellm.layers.linear import prepack_linears_for_cpu
from pagellm.layers.rotary import get_rope
from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward
from pagellm.models.loader import load_hf_config, resolve_model_source
from pagellm.models.registry import get_model_cls, supported_architectures


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ["qwen3", "phi3", "mixtral", "qwen3-moe"])
def test_attention_backends_match_transformers(tiny_model_dir, tiny_tokenizer, arch, backend):
    path = tiny_model_dir(arch)
    registry.set_default_backend(backend)  # layers resolve it on their first step
    try:
        model = ours(path)
        check_against_hf(model, reference(path), tiny_tokenizer(PROMPT).input_ids)
        name = type(model.model.layers[0].self_attn.attn.get_backend(torch.device("cpu")))
        assert name.__name__.lower().startswith(backend)
    finally:
        registry.set_default_backend("auto")


def test_qwen3_skips_the_fused_cpu_step_and_matches_transformers(tiny_model_dir, tiny_tokenizer,
                                                                monkeypatch):
    """The fused step has no q/k norm: Qwen3 layers must take the modules (with the CPU
    kernels: rms_norm, rotary, attention, prepacked linears) and still match transformers."""
    registry.set_default_backend("auto")
    calls = 0
    real = cpu_ops.llama_forward

    def spy(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(cpu_ops, "llama_forward", spy)
    path = tiny_model_dir("qwen3")
    model = ours(path)
    prepack_linears_for_cpu(model)
    assert enable_fused_cpu_forward(model) == 0 and model.model.cpu_fused is None
    check_against_hf(model, reference(path), tiny_tokenizer(PROMPT).input_ids)
    assert calls == 0
    # The same layout without the q/k norm (Qwen2 here) is one the fused step takes, where this
    # CPU has the packed float32 kernel: the refusal above is the attention's, not the dtype's.
    if cpu_ops.linear_packed_supports(torch.empty(16, 32)):
        qwen2 = ours(tiny_model_dir("qwen2"))
        prepack_linears_for_cpu(qwen2)
        assert enable_fused_cpu_forward(qwen2) == 1


def test_qwen3_head_norm_changes_the_output(tiny_model_dir, tiny_tokenizer):
    """Unit q/k norm weights change the logits (so the q/k norm is really applied)."""
    model = ours(tiny_model_dir("qwen3"))
    x = torch.tensor(tiny_tokenizer(PROMPT).input_ids)
    with torch.inference_mode(), set_forward_context(None, []):
        a = model.compute_logits(model(x, torch.arange(len(x))))
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
        b = model.compute_logits(model(x, torch.arange(len(x))))
    assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("use_long", [False, True])
def test_longrope_tables_match_transformers(make_tiny_config, use_long):
    """cos/sin (attention scaling included) as transformers computes them for a sequence past
    the original context (long factors) or within it (short factors)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = make_tiny_config("phi3")
    original = config.rope_parameters["original_max_position_embeddings"]
    max_model_len = 256 if use_long else original
    rope = get_rope(16, 256, config, max_model_len)
    seq_len = 200 if use_long else original
    positions = torch.arange(seq_len)[None]
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    half = rope.cos_cache.shape[1]
    torch.testing.assert_close(rope.cos_cache[:seq_len], cos[0, :, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(rope.sin_cache[:seq_len], sin[0, :, :half], atol=1e-6, rtol=0)
    assert rope.cos_cache[0, 0] > 1.1  # the attention scaling (sqrt(1 + ln 8 / ln 32)) is in


def test_longrope_old_su_config_is_read_as_longrope():
    from types import SimpleNamespace

    factors = [1.0] * 8
    old = SimpleNamespace(rope_theta=1e4, max_position_embeddings=128,
                          original_max_position_embeddings=32,
                          rope_scaling={"type": "su", "short_factor": factors,
                                        "long_factor": [2.0] * 8})
    rope = get_rope(16, 128, old)
    assert rope.cos_cache.shape == (128, 8)
    # short factors all 1: plain rope at position 1 but for the scaling
    scaling = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(32.0))).sqrt()
    short = get_rope(16, 128, old, max_model_len=32)
    torch.testing.assert_close(short.cos_cache[0], torch.full((8,), float(scaling)))
    assert not torch.equal(short.cos_cache, rope.cos_cache)  # 128 > 32: long factors


def test_phi3_short_factors_within_the_original_context(tiny_model_dir, tiny_tokenizer):
    """max_model_len within original_max_position_embeddings (32): the short factors, as
    transformers uses for sequences that short."""
    path = tiny_model_dir("phi3")
    ids = tiny_tokenizer("Paged attention stores keys and values.").input_ids
    assert len(ids) + NUM_NEW <= 32
    short, long = ours(path, max_model_len=32), ours(path)
    expected_tokens, expected_logits = hf_tokens_and_logits(reference(path), ids, NUM_NEW)
    logits = PagedHarness(short).step([("a", ids)], all_logits=True)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)
    assert PagedHarness(short).greedy("a", ids, NUM_NEW) == expected_tokens
    # The long factors (max_model_len 256) give other logits on the same short prompt.
    other = PagedHarness(long).step([("a", ids)], all_logits=True)
    assert (other - expected_logits).abs().max() > 1e-2


def test_phi3_partial_rotary_and_tied_embeddings(tmp_path, make_tiny_model, tiny_tokenizer):
    """Phi-4-mini's layout: longrope over half of each head, tied embeddings."""
    half = 16 // 2 // 2
    path = make_tiny_model(tmp_path / "phi3-partial", "phi3", tie_word_embeddings=True,
                           rope_parameters={
                               "rope_type": "longrope", "rope_theta": 10000.0,
                               "partial_rotary_factor": 0.5,
                               "short_factor": [1.0 + 0.1 * i for i in range(half)],
                               "long_factor": [1.0 + 1.5 * i for i in range(half)]})
    model = ours(path)
    assert model.model.layers[0].self_attn.rotary_emb.rotary_dim == 8
    check_against_hf(model, reference(path), tiny_tokenizer(PROMPT).input_ids)


def test_phi3_loads_fused_checkpoint_tensors(tiny_model_dir):
    """The checkpoint really stores qkv_proj / gate_up_proj (what the loader splits)."""
    from safetensors import safe_open

    path = tiny_model_dir("phi3")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


def test_unknown_architecture_lists_the_supported_ones():
    from types import SimpleNamespace

    assert {"Qwen3ForCausalLM", "Phi3ForCausalLM"} <= set(supported_architectures())
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported; supported "
                                         "architectures: .*Phi3ForCausalLM.*Qwen3ForCausalLM"):
        get_model_cls(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        get_model_cls(SimpleNamespace(architectures=None, model_type="gpt2"))
    assert get_model_cls(SimpleNamespace(architectures=None, model_type="qwen3")).__name__ \
        == "Qwen3ForCausalLM"


def test_qwen3_gguf_tensors_load_like_the_safetensors(tmp_path, tiny_model_dir, tiny_tokenizer):
    """A "qwen3" GGUF (unpermuted, q/k norms as attn_q_norm/attn_k_norm) gives the same model.
    Only the weights: the config comes from the HF folder (transformers reads a qwen3 GGUF's)."""
    import numpy as np
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    from pagellm.models.gguf_loader import _BLOCK_NAMES, _GLOBAL_NAMES, gguf_weights_iterator
    from pagellm.models.weight_utils import default_dtype

    src = tiny_model_dir("qwen3")
    config = load_hf_config(resolve_model_source(str(src)))
    to_gguf = {hf: g for g, hf in {**_GLOBAL_NAMES, **_BLOCK_NAMES}.items()}
    writer = GGUFWriter(str(tmp_path / "q3.gguf"), "qwen3")
    for name, t in load_file(src / "model.safetensors").items():
        stem, _, suffix = name.rpartition(".")
        if stem in to_gguf:
            gguf_name = f"{to_gguf[stem]}.{suffix}"
        else:
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{to_gguf[rest]}.{suffix}"
        writer.add_tensor(gguf_name, np.ascontiguousarray(t.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with default_dtype(torch.float32), torch.device("cpu"):
        from_gguf = get_model_cls(config)(config)
    from_gguf.load_weights(gguf_weights_iterator(str(tmp_path / "q3.gguf"), config,
                                                 torch.float32))
    ids = tiny_tokenizer(PROMPT).input_ids
    expected = PagedHarness(ours(src)).step([("a", ids)], all_logits=True)
    assert torch.equal(PagedHarness(from_gguf.eval()).step([("a", ids)], all_logits=True),
                       expected)


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_engine_greedy_matches_transformers(tiny_model_dir, tiny_tokenizer, arch):
    """Through the engine (its max_model_len picks longrope's factors; prepacked linears, and
    the fused CPU step where it takes the model)."""
    from pagellm import LLM, SamplingParams

    path = tiny_model_dir(arch)
    ids = tiny_tokenizer(PROMPT).input_ids
    expected, _ = hf_tokens_and_logits(reference(path), ids, NUM_NEW)
    try:
        llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_model_len=128,
                  attention_backend="cpu")
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    finally:
        registry.set_default_backend("auto")  # the engine leaves its choice as the default
    assert list(out.token_ids) == expected
