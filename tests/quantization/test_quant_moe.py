"""Mixture-of-Experts models (tiny Mixtral, Qwen3-MoE) under --quantization: every expert's
weight within the dense layers' error bounds, and the quantized model computing exactly the
float model on its dequantized weights (test_quant_model.py's checks, experts included), also
with tensor parallelism (each rank quantizes its own slice of every expert)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from test_quant_model import LAYER_REL_ERROR, _assemble, _build, _linears, _logits

from pagellm.layers.fused_moe import FusedMoE
from pagellm.layers.quantization import param_bytes, quantize_model
from pagellm.models.loader import load_hf_config, resolve_model_source

ARCHS = ["mixtral", "qwen3-moe"]


def _experts(model) -> dict[str, FusedMoE]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FusedMoE)}


def _dequantized_experts(moe: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    assert moe.quant is not None
    return tuple(torch.stack([moe.quant.dequantize(moe, s, e) for e in range(moe.num_experts)])
                 for s in ("w13", "w2"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", ["int8", "int4-g32"])
def test_every_expert_within_error_bound(tiny_model_dir, arch: str, spec: str) -> None:
    path = tiny_model_dir(arch)
    ref = {n: (m.w13_weight.detach().clone(), m.w2_weight.detach().clone())
           for n, m in _experts(_build(path)).items()}
    model = _build(path, spec)
    moes = _experts(model)
    assert set(moes) == set(ref) and len(moes) == 2  # Qwen3-MoE's layer 1 is dense
    for name, moe in moes.items():
        assert not hasattr(moe, "w13_weight") and moe.w13_qweight.dtype in (torch.int8,
                                                                             torch.uint8)
        for stack, deq, want in zip(("w13", "w2"), _dequantized_experts(moe), ref[name],
                                    strict=True):
            for e in range(moe.num_experts):
                rel = float((deq[e] - want[e]).norm() / want[e].norm())
                assert LAYER_REL_ERROR[spec] / 50 < rel < LAYER_REL_ERROR[spec], \
                    (name, stack, e, rel)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("spec", ["int8", "int4-g32"])
def test_model_computes_its_dequantized_experts(tiny_model_dir, arch: str, spec: str,
                                                backend: str) -> None:
    """Independent reference: the float model with every linear and expert weight replaced by
    what the quantized model dequantizes (as test_quant_model.py, whose tolerances these are)."""
    path = tiny_model_dir(arch)
    model = _build(path)
    float_bytes = sum(param_bytes(m) for m in _experts(model).values())
    report = quantize_model(model, spec, backend)
    assert not report.skipped
    assert report.num_quantized == len(_linears(model)) + len(_experts(model))
    assert report.bytes_after == param_bytes(model) < report.bytes_before
    # float32 -> about a byte (int8) or half a byte (int4) per weight, plus scales
    assert sum(param_bytes(m) for m in _experts(model).values()) < float_bytes / 3
    ref_model = _build(path)
    ref_linears, ref_experts = _linears(ref_model), _experts(ref_model)
    with torch.no_grad():
        for name, layer in _linears(model).items():
            ref_linears[name].weight.copy_(layer.quant_method.dequantize(layer))
        for name, moe in _experts(model).items():
            w13, w2 = _dequantized_experts(moe)
            ref_experts[name].w13_weight.copy_(w13)
            ref_experts[name].w2_weight.copy_(w2)
    ref = _logits(ref_model).double()
    got = _logits(model).double()
    rel = float((got - ref).norm() / ref.norm())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    if backend == "torch":  # float32 compute: the same model up to summation order
        assert rel < 1e-5, rel
    else:  # the CPU ops compute in bf16
        assert rel < 0.08 and agree >= 0.85, (rel, agree)


def test_experts_stay_float_without_a_common_group(tiny_model_dir, make_tiny_model,
                                                   tmp_path) -> None:
    """int4 needs a group dividing both the hidden size (64) and the expert width: 48 has
    none of 32..256 in common with 64 (gcd 16), so the experts stay float, reported as such."""
    path = make_tiny_model(tmp_path / "m", "mixtral", intermediate_size=48)
    model = _build(path)
    report = quantize_model(model, "int4", "torch")
    names = set(_experts(model))
    assert names and names <= set(report.skipped)
    assert all(m.quant is None and m.w13_weight.is_floating_point()
               for m in _experts(model).values())


def _tp_worker(rank: int, store: str, path: str, out_dir: str) -> None:
    from pagellm.distributed.parallel_state import destroy_tp, init_tp

    torch.set_num_threads(1)
    init_tp(rank, 2, "gloo", init_method=f"file://{store}")
    try:
        model = _build(path)
        quantize_model(model, "int8", "torch")  # float32 compute: a tight comparison
        linears = {n: m.quant_method.dequantize(m) for n, m in _linears(model).items()}
        experts = {n: _dequantized_experts(m) for n, m in _experts(model).items()}
        torch.save((_logits(model), linears, experts), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        destroy_tp()
    os._exit(0)  # NOTE: as test_quant_model.py's worker: gloo's teardown can abort the process


def test_tensor_parallel_quantizes_each_experts_slice(tmp_path, tiny_model_dir) -> None:
    """tp=2: each rank holds and quantizes half of every expert's width (int8: per-row scales
    of its gate/up rows, of its half of down's columns); the model computes exactly the experts
    its ranks dequantize, put back together."""
    path = str(tiny_model_dir("mixtral"))
    mp.start_processes(_tp_worker, args=(str(tmp_path / "store"), path, str(tmp_path)),
                       nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    config = load_hf_config(resolve_model_source(path))
    ref = _build(path)
    float_experts = {n: (m.w13_weight.detach().clone(), m.w2_weight.detach().clone())
                     for n, m in _experts(ref).items()}
    with torch.no_grad():
        for name, layer in _linears(ref).items():
            layer.weight.copy_(_assemble(name, [r[1][name] for r in ranks], config))
        for name, moe in _experts(ref).items():
            (w13_0, w2_0), (w13_1, w2_1) = (r[2][name] for r in ranks)
            half = w13_0.shape[1] // 2
            assert half * 2 == moe.intermediate_size  # each rank: half of the width
            moe.w13_weight.copy_(torch.cat([w13_0[:, :half], w13_1[:, :half],
                                            w13_0[:, half:], w13_1[:, half:]], dim=1))
            moe.w2_weight.copy_(torch.cat([w2_0, w2_1], dim=2))
            for got, want in zip((moe.w13_weight, moe.w2_weight), float_experts[name],
                                 strict=True):
                rel = float((got - want).norm() / want.norm())
                assert LAYER_REL_ERROR["int8"] / 50 < rel < LAYER_REL_ERROR["int8"], (name, rel)
    expected = _logits(ref)
    for logits, _, _ in ranks:
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
