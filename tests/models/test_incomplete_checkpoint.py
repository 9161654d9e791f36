"""A checkpoint that lacks one shard of a fused parameter (q/k/v of qkv_proj, gate/up of
gate_up_proj, a Qwen2 q/k/v bias) or holds only part of a tensor must fail to load, naming the
checkpoint tensor, on every tensor-parallel rank and from safetensors and GGUF alike; a complete
one loads as before. Without the check the fused parameter would keep the uninitialized memory of
the shard that never came."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagellm.distributed import parallel_state
from pagellm.models.gguf_loader import gguf_weights_iterator
from pagellm.models.loader import build_model, load_hf_config, resolve_model_source
from pagellm.models.registry import get_model_cls
from pagellm.models.weight_utils import default_dtype

CPU = torch.device("cpu")


def _copy_without(src: Path, dst: Path, drop: str | None = None,
                  replace: dict[str, torch.Tensor] | None = None) -> Path:
    """``src``'s model folder at ``dst``, its safetensors rewritten without ``drop``."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    if drop is not None:
        del state[drop]
    state.update(replace or {})
    save_file(state, dst / "model.safetensors")
    return dst


def _load(path: Path) -> torch.nn.Module:
    src = resolve_model_source(str(path))
    return build_model(load_hf_config(src), src, torch.float32, CPU)


@pytest.mark.parametrize("arch,tensor", [
    ("llama", "model.layers.0.self_attn.k_proj.weight"),
    ("llama", "model.layers.1.self_attn.q_proj.weight"),
    ("llama", "model.layers.1.self_attn.v_proj.weight"),
    ("llama", "model.layers.0.mlp.up_proj.weight"),
    ("llama", "model.layers.1.mlp.gate_proj.weight"),
    ("qwen2", "model.layers.0.self_attn.k_proj.bias"),
    ("qwen2", "model.layers.1.self_attn.v_proj.weight"),
])
def test_missing_shard_of_a_fused_parameter_is_named(tmp_path, tiny_model_dir, arch,
                                                     tensor) -> None:
    path = _copy_without(tiny_model_dir(arch), tmp_path / "m", drop=tensor)
    with pytest.raises(ValueError, match=f"{tensor} missing from the checkpoint"):
        _load(path)


def test_complete_checkpoint_loads_every_shard(tiny_model_dir) -> None:
    for arch in ("llama", "qwen2"):
        path = tiny_model_dir(arch)
        model = _load(path)
        state = load_file(path / "model.safetensors")
        attn = model.model.layers[0].self_attn
        q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        assert torch.equal(k, state["model.layers.0.self_attn.k_proj.weight"])
        assert torch.equal(v, state["model.layers.0.self_attn.v_proj.weight"])
        up = model.model.layers[1].mlp.gate_up_proj.weight.chunk(2)[1]
        assert torch.equal(up, state["model.layers.1.mlp.up_proj.weight"])
        if arch == "qwen2":
            k_bias = attn.qkv_proj.bias.split([attn.q_size, attn.kv_size, attn.kv_size])[1]
            assert torch.equal(k_bias, state["model.layers.0.self_attn.k_proj.bias"])


def _build_as_rank(path: Path, rank: int, size: int,
                   monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """``path``'s model as tensor-parallel ``rank`` of ``size`` builds and loads it (loading
    needs no process group: each rank reads the full tensors and keeps its slice)."""
    with monkeypatch.context() as m:
        m.setattr(parallel_state, "_TP_RANK", rank)
        m.setattr(parallel_state, "_TP_SIZE", size)
        return _load(path)


@pytest.mark.parametrize("rank", [0, 1])
def test_every_tp_rank_refuses_a_missing_or_partial_tensor(tmp_path, tiny_model_dir, rank,
                                                           monkeypatch) -> None:
    src = tiny_model_dir("llama")
    full = _build_as_rank(src, rank, 2, monkeypatch)  # a complete checkpoint loads on both
    assert full.model.layers[0].self_attn.qkv_proj.tp_size == 2
    missing = _copy_without(src, tmp_path / "missing", drop="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight missing"):
        _build_as_rank(missing, rank, 2, monkeypatch)
    # Only one tp shard's rows of k_proj (a pre-split checkpoint): rank 0 could take them, so
    # every rank must refuse the tensor by its shape.
    k = load_file(src / "model.safetensors")["model.layers.1.self_attn.k_proj.weight"]
    half = {"model.layers.1.self_attn.k_proj.weight": k[: k.shape[0] // 2].clone()}
    partial = _copy_without(src, tmp_path / "partial", replace=half)
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        _build_as_rank(partial, rank, 2, monkeypatch)


def test_too_long_tensor_is_refused(tmp_path, tiny_model_dir) -> None:
    src = tiny_model_dir("llama")
    up = load_file(src / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    longer = {"model.layers.0.mlp.up_proj.weight": torch.cat([up, up[:8]])}
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        _load(_copy_without(src, tmp_path / "m", replace=longer))


def _hf_to_gguf_name(name: str) -> str:
    from pagellm.models.gguf_loader import _BLOCK_NAMES, _GLOBAL_NAMES

    stem, _, suffix = name.rpartition(".")
    for gguf, hf in _GLOBAL_NAMES.items():
        if stem == hf:
            return f"{gguf}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    gguf = next(g for g, hf in _BLOCK_NAMES.items() if hf == rest)
    return f"blk.{layer}.{gguf}.{suffix}"


def _write_gguf(path: Path, state: dict[str, torch.Tensor]) -> None:
    """A "qwen2" GGUF (stored unpermuted) of float32 tensors: only what the loader reads."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "qwen2")
    for name, t in state.items():
        writer.add_tensor(_hf_to_gguf_name(name), np.ascontiguousarray(t.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_missing_shard_is_named(tmp_path, tiny_model_dir) -> None:
    src = tiny_model_dir("qwen2")
    config = load_hf_config(resolve_model_source(str(src)))
    state = load_file(src / "model.safetensors")

    def load(gguf: Path) -> torch.nn.Module:
        with default_dtype(torch.float32), CPU:
            model = get_model_cls(config)(config)
        model.load_weights(gguf_weights_iterator(str(gguf), config, torch.float32))
        return model

    _write_gguf(tmp_path / "full.gguf", state)
    model = load(tmp_path / "full.gguf")
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)[1],
                       state["model.layers.0.mlp.up_proj.weight"])
    for drop in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.1.mlp.gate_proj.weight"):
        _write_gguf(tmp_path / "part.gguf", {n: t for n, t in state.items() if n != drop})
        with pytest.raises(ValueError, match=f"{drop} missing from the checkpoint"):
            load(tmp_path / "part.gguf")
