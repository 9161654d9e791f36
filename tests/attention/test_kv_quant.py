"""8-bit KV caches (--kv-cache-dtype): round-trip error bounds, the C++ writes against the torch
quantizer, and the torch and cpu backends on quantized caches against a float64 attention over
the dequantized K/V written here (decode, prefill with and without context, GQA, windows).

The batches and their reference are in kv_quant_cases.py.
"""

from __future__ import annotations

import pytest
import torch
from kv_quant_cases import KINDS, MIXED, QuantCase, make_quant

from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.kv_quant import (
    KVQuant,
    dequantize,
    quantize,
    quantize_fp8,
    quantize_int8,
    storage_dtype,
    write_kv_quant,
)
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.kernels import cpu_kv_quant, cpu_ops

# Relative round-trip error bound per value: half an ulp of the format (3 and 2 mantissa bits),
# and for int8 half a step of absmax / 127 (relative to the row's absmax; the step is rounded to
# bfloat16, 2^-9 relative, and the largest value clamped to 127 steps).
REL_BOUND = {"fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3, "int8_per_token_head": 0.5 / 127}
needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler")


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_bound(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=g) * torch.logspace(-2, 2, 64)[:, None, None]
    q, scales = quantize(x, KVQuant(kind), "k")
    y = dequantize(q, scales, KVQuant(kind), "k")
    err = (y - x).abs()
    if kind == "int8_per_token_head":
        bound = REL_BOUND[kind] * x.abs().amax(-1, keepdim=True) * (1 + 2.0 ** -8)
    else:
        # Normal values: relative; the smallest (subnormal) ones: half the subnormal step.
        step = 2.0 ** (-9 if kind == "fp8_e4m3" else -16)
        bound = torch.maximum(REL_BOUND[kind] * x.abs(), torch.full_like(x, step / 2))
    assert (err <= bound).all()


def test_fp8_saturates_and_scales():
    x = torch.tensor([1e6, -1e6, 3.0, 0.0])
    assert quantize_fp8(x, "fp8_e4m3", 1.0).view(torch.float8_e4m3fn).float().tolist() == \
        [448.0, -448.0, 3.0, 0.0]
    q = quantize_fp8(x, "fp8_e4m3", 2.0)
    assert dequantize(q, None, KVQuant("fp8_e4m3", 2.0), "k").tolist()[2:] == [3.0, 0.0]


def test_int8_zero_row():
    q, s = quantize_int8(torch.zeros(2, 3, 16))
    assert (q == 0).all() and (s == 0).all()


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_write_matches_torch(kind, dtype):
    g = torch.Generator().manual_seed(1)
    T, H, D, bs, nb = 40, 2, 80, 16, 6  # D = 80: the vector loop and its scalar tail
    qkv = (torch.randn(T, 3, H, D, generator=g) * 3).to(dtype)
    qkv[3, 1] = 0  # a zero row: scale 0
    key, value = qkv[:, 1], qkv[:, 2]  # strided token rows, as sliced from a QKV projection
    slots = torch.randperm(nb * bs, generator=g)[:T]
    shape = (nb, bs, H, D)
    caches = [torch.zeros(shape, dtype=storage_dtype(kind)) for _ in range(4)]
    quants = [make_quant(kind, nb * bs, H, 0.5, 2.0) for _ in range(2)]
    for q in quants:
        if q.k_scales is not None:
            q.k_scales.zero_()
            q.v_scales.zero_()
    write_kv_quant(key, value, caches[0], caches[1], slots, quants[0])
    cpu_kv_quant.write_kv(key, value, caches[2], caches[3], slots, quants[1])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    if kind == "int8_per_token_head":
        assert torch.equal(quants[0].k_scales, quants[1].k_scales)
        assert torch.equal(quants[0].v_scales, quants[1].v_scales)


TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend,
                                         pytest.param(CpuAttentionBackend, marks=needs_kernels)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype,window", [
    (16, 4, 2, 64, torch.float32, None),
    (8, 4, 1, 80, torch.bfloat16, None),
    (1, 2, 2, 32, torch.float32, None),
    (16, 8, 2, 128, torch.bfloat16, 9),
])
def test_backends_on_quantized_cache(backend_cls, kind, block_size, num_heads, num_kv_heads,
                                     head_dim, dtype, window):
    case = QuantCase(MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, kind)
    scale = head_dim ** -0.5
    backend = backend_cls(num_heads, head_dim, num_kv_heads, scale, window)
    out = case.run(backend)
    ref = case.reference(scale, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend,
                                         pytest.param(CpuAttentionBackend, marks=needs_kernels)])
@pytest.mark.parametrize("kind", KINDS)
def test_soft_cap_and_wide_groups(backend_cls, kind):
    """Gemma 2's logit soft-cap, 8 query heads a kv head, 40-row chunks (several row tiles)."""
    case = QuantCase([(30, 40), (50, 1), (0, 40)], 16, 8, 1, 64, torch.float32, kind, seed=2)
    scale = 0.5  # large scores, so the cap bites
    out = case.run(backend_cls(8, 64, 1, scale, None, 5.0))
    torch.testing.assert_close(out.double(), case.reference(scale, None, 5.0), atol=1e-4,
                               rtol=1e-4)


@needs_kernels
def test_cpu_kernel_refuses_out_of_bounds_block():
    case = QuantCase([(20, 1)], 16, 2, 2, 32, torch.float32, "fp8_e4m3")
    case.meta.block_tables[0, 0] = 10_000
    with pytest.raises(IndexError):
        case.run(CpuAttentionBackend(2, 32, 2, 32 ** -0.5))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_cpu_generic_build_on_quantized_cache(kind):
    """The plain loops (no AVX-512): scalar fp8 decoding and the scalar tails."""
    try:
        ctx = cpu_ops.built_for("generic")
        ctx.__enter__()
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        case = QuantCase(MIXED[:4], 8, 4, 2, 48, torch.float32, kind)
        scale = 48 ** -0.5
        out = case.run(CpuAttentionBackend(4, 48, 2, scale))
        torch.testing.assert_close(out.double(), case.reference(scale), atol=1e-4, rtol=1e-4)
    finally:
        ctx.__exit__(None, None, None)


def test_checkpoint_kv_scales_land_on_the_layer():
    from torch import nn

    from pagellm.layers.attention import Attention
    from pagellm.models.kv_scales import load_kv_scale

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    for i, layer in enumerate(model.model.layers):
        layer.self_attn = nn.Module()
        layer.self_attn.attn = Attention(2, 16, 1, 0.25, i)
    assert load_kv_scale(model, "model.layers.0.self_attn.k_scale", torch.tensor(0.5))
    assert load_kv_scale(model, "model.layers.0.self_attn.v_proj.output_scale",
                         torch.tensor([0.25, 2.0]))
    assert load_kv_scale(model, "model.layers.1.self_attn.kv_scale", torch.tensor(3.0))
    assert not load_kv_scale(model, "model.layers.1.self_attn.q_proj.weight", torch.ones(1))
    attn0, attn1 = (layer.self_attn.attn for layer in model.model.layers)
    assert (attn0.k_scale, attn0.v_scale, attn1.k_scale, attn1.v_scale) == (0.5, 2.0, 3.0, 3.0)
    with pytest.raises(ValueError, match="must be > 0"):
        load_kv_scale(model, "model.layers.1.self_attn.k_scale", torch.tensor(0.0))


# (context_len, query_len): decode tokens, short chunks (the decode kernel's rows), chunks across
# tile and 64-key step edges, a long chunk with and without context.
ODD = [(0, 300), (200, 1), (37, 3), (100, 64), (5, 130), (70, 4), (0, 1), (129, 65), (31, 2)]


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype,window,cap", [
    (16, 9, 3, 64, torch.bfloat16, None, None),   # the default model's shape
    (32, 8, 2, 128, torch.bfloat16, 50, None),
    (16, 4, 4, 64, torch.float32, 33, None),
    (32, 6, 1, 64, torch.float32, None, 4.0),
    (16, 16, 2, 64, torch.bfloat16, 70, 6.0),     # 8 query heads a kv head
    (16, 4, 2, 96, torch.bfloat16, None, None),   # tile kernel in float32 (96 % 32 != 0)
    (1, 6, 2, 64, torch.bfloat16, 40, None),      # one-token blocks
    (8, 6, 2, 128, torch.float32, None, None),
])
def test_cpu_kernels_odd_shapes(kind, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                window, cap, cpu_isa):
    """Each kernel build: decode rows, tiles of rows and the plain loops, against float64."""
    case = QuantCase(ODD, block_size, num_heads, num_kv_heads, head_dim, dtype, kind, seed=4)
    scale = 0.3 if cap else head_dim ** -0.5
    out = case.run(CpuAttentionBackend(num_heads, head_dim, num_kv_heads, scale, window, cap))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), case.reference(scale, window, cap), atol=TOL[dtype],
                               rtol=TOL[dtype])
