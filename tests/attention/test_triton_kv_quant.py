"""The Triton backend on 8-bit KV caches (--kv-cache-dtype): its quantizing store against the
torch quantizer (the same bytes and scales), and its paged attention against the float64
reference over the dequantized K/V (kv_quant_cases.py). Without CUDA under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from kv_quant_cases import KINDS, MIXED, QuantCase, make_quant  # noqa: E402

from pagellm.attention.kv_quant import storage_dtype, write_kv_quant  # noqa: E402
from pagellm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagellm.attention.triton_kv_quant import reshape_and_cache_quant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_matches_torch_quantizer(kind, dtype):
    g = torch.Generator().manual_seed(3)
    T, H, D, bs, nb = 12, 2, 48, 16, 3
    qkv = (torch.randn(T, 3, H, D, generator=g) * 4).to(dtype)
    qkv[2, 1] = 0
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[5] = -1  # a padded token: not stored
    caches = [torch.zeros((nb, bs, H, D), dtype=storage_dtype(kind)) for _ in range(4)]
    ref, got = make_quant(kind, nb * bs, H, 0.5, 2.0), make_quant(kind, nb * bs, H, 0.5, 2.0)
    for q in (ref, got):
        if q.k_scales is not None:
            q.k_scales.zero_()
            q.v_scales.zero_()
    keep = slots >= 0
    write_kv_quant(key[keep], value[keep], caches[0], caches[1], slots[keep], ref)
    dev = [c.to(DEVICE) for c in caches[2:]]
    if got.k_scales is not None:
        got.k_scales, got.v_scales = got.k_scales.to(DEVICE), got.v_scales.to(DEVICE)
    reshape_and_cache_quant(key.to(DEVICE), value.to(DEVICE), dev[0], dev[1], slots.to(DEVICE),
                            got)
    assert torch.equal(caches[0], dev[0].cpu()) and torch.equal(caches[1], dev[1].cpu())
    if ref.k_scales is not None:
        assert torch.equal(ref.k_scales, got.k_scales.cpu())
        assert torch.equal(ref.v_scales, got.v_scales.cpu())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype,window", [
    (16, 4, 2, 64, torch.float32, None),
    (16, 4, 1, 32, torch.bfloat16, 9),
])
def test_attention_on_quantized_cache(kind, block_size, num_heads, num_kv_heads, head_dim,
                                      dtype, window):
    case = QuantCase(MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, kind)
    case.to(DEVICE)
    scale = head_dim ** -0.5
    out = case.run(TritonAttentionBackend(num_heads, head_dim, num_kv_heads, scale, window))
    ref = case.reference(scale, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])
