"""Mixture-of-Experts families (Mixtral, Qwen3-MoE) against transformers on tiny checkpoints
(4 experts, top-2, hidden 64, expert width 32; both attention backends against transformers are
in test_qwen3_phi3.py with the other new families): the fused CPU step refusing MoE layers,
Qwen3-MoE's dense layers and top-k choice, and the loader's checks on per-expert tensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hf_compare import PROMPT, check_against_hf, ours, reference
from safetensors.torch import load_file, save_file

from pagellm.attention import registry
from pagellm.kernels import cpu_ops
from pagellm.layers.fused_moe import SparseMoeBlock
from pagellm.layers.linear import prepack_linears_for_cpu
from pagellm.models.llama import LlamaMLP
from pagellm.models.llama_cpu_fused import LlamaCpuFused, enable_fused_cpu_forward

ARCHS = ["mixtral", "qwen3-moe"]


def test_qwen3_moe_layer_kinds_and_routing(tiny_model_dir, make_tiny_model, tmp_path,
                                           tiny_tokenizer):
    """mlp_only_layers=[1]: layers 0 and 2 sparse, 1 dense; norm_topk_prob off in the tiny
    model, on here (a different output, still transformers')."""
    model = ours(tiny_model_dir("qwen3-moe"))
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock, LlamaMLP, SparseMoeBlock]
    assert model.model.layers[0].mlp.experts.renormalize is False
    path = make_tiny_model(tmp_path / "renorm", "qwen3-moe", norm_topk_prob=True,
                           mlp_only_layers=[], decoder_sparse_step=2)
    model = ours(path)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [LlamaMLP, SparseMoeBlock, LlamaMLP]
    assert model.model.layers[1].mlp.experts.renormalize is True
    check_against_hf(model, reference(path), tiny_tokenizer(PROMPT).input_ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_cpu_step_refuses_moe_layers(tiny_model_dir, tiny_tokenizer, monkeypatch, arch):
    """The fused kernel has no router or experts: MoE models take the modules (with the CPU
    kernels) and still match transformers; the dense Llama beside them is taken."""
    registry.set_default_backend("auto")
    calls = 0
    real = cpu_ops.llama_forward

    def spy(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(cpu_ops, "llama_forward", spy)
    path = tiny_model_dir(arch)
    model = ours(path)
    prepack_linears_for_cpu(model)
    assert LlamaCpuFused.build(model.model) is None
    assert enable_fused_cpu_forward(model) == 0 and model.model.cpu_fused is None
    check_against_hf(model, reference(path), tiny_tokenizer(PROMPT).input_ids)
    assert calls == 0
    if cpu_ops.linear_packed_supports(torch.empty(16, 32)):
        llama = ours(tiny_model_dir("llama"))
        prepack_linears_for_cpu(llama)
        assert enable_fused_cpu_forward(llama) == 1


def _copy_without(src: Path, dst: Path, drop: list[str]) -> Path:
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    for name in drop:
        del state[name]
    save_file(state, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("arch,drop", [
    ("mixtral", ["model.layers.0.block_sparse_moe.experts.3.w3.weight"]),
    ("mixtral", ["model.layers.1.block_sparse_moe.experts.0.w2.weight",
                 "model.layers.1.block_sparse_moe.gate.weight"]),
    ("qwen3-moe", ["model.layers.2.mlp.experts.1.gate_proj.weight"]),
    ("qwen3-moe", ["model.layers.0.mlp.experts.2.down_proj.weight"]),
    ("qwen3-moe", ["model.layers.1.mlp.up_proj.weight"]),  # the dense layer
])
def test_missing_expert_tensor_is_named(tiny_model_dir, tmp_path, arch, drop):
    path = _copy_without(tiny_model_dir(arch), tmp_path / "ckpt", drop)
    with pytest.raises(ValueError, match="missing from the checkpoint") as e:
        ours(path)
    for name in drop:
        assert name in str(e.value)


def test_expert_of_the_wrong_shape_is_refused(tiny_model_dir, tmp_path):
    path = shutil.copytree(tiny_model_dir("mixtral"), tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
    state[name] = state[name][:16]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        ours(path)
