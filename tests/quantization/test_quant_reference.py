"""The reference quantizers: flag parsing, error bounds, packing, and PyTorch's CPU int4 layout."""

from __future__ import annotations

import pytest
import torch

from pagellm.layers.quant_methods import unpack_int4_cpu
from pagellm.layers.quantization import (
    QuantConfig,
    choose_group_size,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    parse_quantization,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero row (and groups)
    w[1, :7] *= 40.0  # outliers
    return w


def test_parse_quantization() -> None:
    assert parse_quantization(None) is None
    assert parse_quantization("none") is None
    assert parse_quantization("INT8") == QuantConfig("int8")
    assert parse_quantization("int4") == QuantConfig("int4", 32)
    assert parse_quantization("int4-g32") == QuantConfig("int4", 32)
    assert parse_quantization("int4-g32").name == "int4-g32"
    for bad in ("int3", "int4-g48", "int4-g", "fp8", "int4-g1024"):
        with pytest.raises(ValueError, match="--quantization"):
            parse_quantization(bad)


def test_int8_error_bound() -> None:
    w = _weight(48, 96)
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (48,)
    assert int(q.abs().max()) == 127  # every non-zero row uses the full range
    err = (dequantize_int8(q, scales) - w).abs()
    # Round to nearest: at most half a step (plus float32 rounding) per weight.
    assert torch.all(err <= scales[:, None] / 2 * (1 + 1e-5) + 1e-7)
    assert torch.all(dequantize_int8(q, scales)[0] == 0)
    # The bound is attained-ish on random data: the error is not trivially zero.
    assert err[2:].max() > scales[2:].min() / 4


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_bound(group: int) -> None:
    w = _weight(40, 256)
    codes, scales, mins = quantize_int4(w, group)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert scales.shape == mins.shape == (40, 256 // group)
    deq = dequantize_int4(codes, scales, mins)
    step = scales.repeat_interleave(group, dim=1)
    assert torch.all((deq - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7)
    # min and max of every group are represented (codes 0 and 15 present, up to float error)
    g = w.reshape(40, -1, group)
    d = deq.reshape(40, -1, group)
    torch.testing.assert_close(d.amin(-1), g.amin(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(d.amax(-1), g.amax(-1), atol=1e-6, rtol=1e-6)


def test_int4_reproduces_q4_1_blocks() -> None:
    # A GGUF Q4_1 block dequantizes to d * q + m with q in 0..15 (llama.cpp's min/max rounding
    # uses both ends). Requantizing at group 32 recovers its codes, and the values to float error.
    g = torch.Generator().manual_seed(1)
    d = (torch.rand(16, 4, 1, generator=g) * 0.01 + 1e-3).half().float()
    m = (-8 * d + torch.randn(16, 4, 1, generator=g) * 1e-3).half().float()
    q = torch.randint(0, 16, (16, 4, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).reshape(16, 128)
    codes, scales, mins = quantize_int4(w, 32)
    assert torch.equal(codes.long(), q.reshape(16, 128))
    torch.testing.assert_close(dequantize_int4(codes, scales, mins), w, atol=1e-7, rtol=1e-6)


def test_pack_unpack_roundtrip() -> None:
    codes = torch.randint(0, 16, (24, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (24, 32)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0]) and torch.equal(packed[:, 0] >> 4,
                                                                       codes[:, 1])
    assert torch.equal(unpack_int4(packed), codes)


def test_choose_group_size() -> None:
    assert choose_group_size(4096, 128) == 128
    assert choose_group_size(576, 128) == 64  # SmolLM2's hidden size
    assert choose_group_size(288, 128) == 32  # its o_proj shard at tp=2
    assert choose_group_size(576, 32) == 32
    assert choose_group_size(48, 128) is None


@pytest.mark.parametrize("n,k", [(64, 64), (128, 96), (16, 32), (48, 64), (112, 128),
                                 (960, 64)])
def test_cpu_int4_layout(n: int, k: int) -> None:
    # Our reading of torch's packed layout must invert its packing exactly (all tail sizes).
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(unpack_int4_cpu(packed, n, k), codes)
