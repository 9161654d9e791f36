"""Quantized linear layers, every backend, against ``x @ dequantize(W)^T + b`` in float64.

"cpu" runs PyTorch's weight-only ops (and the dequantize path above the row threshold);
"triton" runs the CUDA kernel, under TRITON_INTERPRET=1 when there is no GPU; "torch"
dequantizes with torch ops. The dequantized weight itself is checked against the float weight
with the half-step error bound.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from pagellm.layers import quant_methods  # noqa: E402
from pagellm.layers.linear import ReplicatedLinear  # noqa: E402
from pagellm.layers.quantization import parse_quantization  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["cpu", "torch", "triton"] if DEVICE == "cpu" else ["torch", "triton"]
ROWS = [1, 5, quant_methods.INT8_KERNEL_MAX_ROWS + 1, quant_methods.INT4_KERNEL_MAX_ROWS + 3]


def _layer(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> ReplicatedLinear:
    g = torch.Generator().manual_seed(seed)
    layer = ReplicatedLinear(k, n, bias=True, params_dtype=dtype).to(DEVICE)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3, :5] = 1.0  # an outlier row
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(n, generator=g) * 0.1)
    return layer


def _compute_dtype(backend: str, dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if backend == "cpu" and dtype == torch.float32 else dtype


def _weight_bound(w: torch.Tensor, spec: str, stored: torch.dtype) -> torch.Tensor:
    """Half a quantization step per weight, plus the rounding of scales (and mins or zero points)
    stored in ``stored``: half an ulp of each, times the code that multiplies it."""
    cfg = parse_quantization(spec)
    n, k = w.shape
    if cfg.method == "int8":
        group = k
        absmax = w.abs().reshape(n, -1, group).amax(-1)
        step, stored_err = absmax / 127, absmax  # |q * scale| <= absmax
    else:
        group = cfg.group_size
        g = w.reshape(n, -1, group)
        step = (g.amax(-1) - g.amin(-1)) / 15
        stored_err = g.amin(-1).abs() + 16 * step  # |min| (or |zero| = |min + 8 scale|) + |q| scale
    half_ulp = 0.0 if stored == torch.float32 else 2.0**-8 * 1.01  # bf16 unit roundoff
    bound = step / 2 * (1 + 1e-5) + half_ulp * stored_err + 1e-7
    return bound.repeat_interleave(group, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["int8", "int4-g32", "int4-g64"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_linear_matches_reference(backend: str, spec: str, dtype: torch.dtype) -> None:
    n, k = 72, 128  # 72 rows: not a multiple of 16, so the CPU int4 op gets padding rows
    layer = _layer(n, k, dtype)
    w = layer.weight.detach().float().cpu()
    bias = layer.bias.detach().double().cpu()
    group = layer.quantize_(parse_quantization(spec), backend)
    assert group == parse_quantization(spec).group_size
    assert "weight" not in dict(layer.named_parameters())

    deq = layer.quant_method.dequantize(layer).float().cpu()
    assert deq.shape == (n, k)
    stored = _compute_dtype(backend, dtype)
    assert torch.all((deq - w).abs() <= _weight_bound(w, spec, stored))

    cdt = _compute_dtype(backend, dtype)
    g = torch.Generator().manual_seed(1)
    for rows in ROWS:  # CPU: the op below the row threshold, dequantize + matmul above it
        x = (torch.randn(rows, k, generator=g)).to(dtype)
        y = layer(x.to(DEVICE)).cpu()
        assert y.dtype == dtype and y.shape == (rows, n)
        ref = x.to(cdt).double() @ deq.double().T + bias
        scale = ref.abs().max()
        tol = 2e-6 if cdt == torch.float32 else 1.5e-2  # bf16 outputs and bias add
        assert (y.double() - ref).abs().max() <= tol * scale, (rows, backend)


def test_leading_dims_and_row_parallel_style_bias() -> None:
    layer = _layer(64, 64, torch.float32)
    layer.quantize_(parse_quantization("int8"), BACKENDS[0])
    x = torch.randn(2, 3, 64, device=DEVICE)
    y = layer(x)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y.reshape(6, 64), layer(x.reshape(6, 64)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_bytes(backend: str) -> None:
    n, k = 96, 256
    for spec in ("int8", "int4-g32"):
        layer = _layer(n, k, torch.bfloat16)
        before = sum(p.numel() * p.element_size() for p in layer.parameters())
        layer.quantize_(parse_quantization(spec), backend)
        after = sum(p.numel() * p.element_size() for p in layer.parameters())
        bias = n * 2
        if spec == "int8":
            expect = n * k + n * 2 + bias  # int8 weight + one bf16 scale per row
        else:
            expect = n * k // 2 + 2 * n * (k // 32) * 2 + bias  # nibbles + bf16 scale & zero
        assert after == expect, (spec, backend)
        assert after < before * (0.52 if spec == "int8" else 0.33)


def test_int4_group_falls_back_or_keeps_float() -> None:
    cfg = parse_quantization("int4-g128")
    layer = _layer(32, 96, torch.float32)  # 96 is not a multiple of 128 or 64
    assert layer.quantize_(cfg, BACKENDS[0]) == 32
    # An input size that is not a multiple of 32 stays in float, bit for bit.
    layer = _layer(32, 48, torch.float32)
    x = torch.randn(4, 48, device=DEVICE)
    expect = F.linear(x, layer.weight, layer.bias)
    assert layer.quantize_(cfg, BACKENDS[0]) is None
    assert layer.quant_method is None and "weight" in dict(layer.named_parameters())
    assert torch.equal(layer(x), expect)


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU int4 op layout")
def test_cpu_int4_unknown_layout_fallback() -> None:
    # If torch ever changed its packing, the layer must still be right: it then reads the codes
    # back through the op itself and always multiplies with the op.
    layer = _layer(80, 64, torch.bfloat16)
    layer.quantize_(parse_quantization("int4-g32"), "cpu")
    known = layer.quant_method.dequantize(layer)
    x = torch.randn(quant_methods.INT4_KERNEL_MAX_ROWS + 8, 64, dtype=torch.bfloat16)
    y_known = layer(x)
    layer.quant_method.layout_known = False
    assert torch.equal(layer.quant_method.dequantize(layer), known)
    torch.testing.assert_close(layer(x), y_known, atol=2e-2, rtol=2e-2)


def test_quantize_twice_is_an_error() -> None:
    layer = _layer(32, 64, torch.float32)
    layer.quantize_(parse_quantization("int8"), BACKENDS[0])
    with pytest.raises(AssertionError):
        layer.quantize_(parse_quantization("int8"), BACKENDS[0])


def test_backend_checks() -> None:
    from pagellm.layers.quantization import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda-magic", torch.device("cpu"))
