"""Triton RMSNorm (+ residual), rotary and SiLU-and-mul against the layers' torch paths.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors. float32 must agree to
float32 round-off; bfloat16 to the bit on all but a small fraction of elements, which may differ
by one ulp (two for RMSNorm and SiLU: see assert_matches). Covers strided rows (q/k views of a QKV
projection, sliced activations), partial rotary, GQA head counts and hidden sizes that are not
powers of two.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from pagellm.layers import triton_ops  # noqa: E402
from pagellm.layers.activation import SiluAndMul  # noqa: E402
from pagellm.layers.norm import RMSNorm  # noqa: E402
from pagellm.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.bfloat16)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (16-bit) dtype lie between ``a`` and ``b``."""
    assert a.dtype == b.dtype and a.element_size() == 2

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(torch.int16).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (ordered(a) - ordered(b)).abs()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, max_frac: float = 0.01,
                   max_ulp: int = 1) -> None:
    """float32: round-off. 16-bit: at most ``max_ulp`` apart on at most ``max_frac``. RMSNorm and
    SiLU pass 2: a last-ulp change of a float32 intermediate (the variance's summation order,
    exp) moves a rounded 16-bit intermediate by one ulp, which the next multiply (by the weight,
    by up) can widen to two. Under the interpreter bfloat16 comes out bit-equal here."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    dist = ulp_distance(out.cpu(), ref.cpu())
    assert dist.max().item() <= max_ulp, f"max ulp distance {dist.max().item()}"
    frac = (dist > 0).float().mean().item()
    assert frac <= max_frac, f"{frac:.2%} of the elements differ"


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 100, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    rows = 5
    norm = RMSNorm(hidden, eps=1e-5).to(DEVICE, dtype)
    norm.weight.data.copy_(rand(hidden, dtype=dtype, seed=1, scale=0.5) + 1.0)
    # Strided rows: x is the left part of a wider activation.
    x = rand(rows, hidden + 24, dtype=dtype, seed=2, scale=3.0)[:, :hidden]
    residual = rand(rows, hidden, dtype=dtype, seed=3) if with_residual else None
    x_before = x.clone()

    out, summed = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
    ref = norm.forward_native(x, residual)
    if with_residual:
        ref, ref_summed = ref
        assert torch.equal(summed, ref_summed)  # the add is one rounding in both paths
    else:
        assert summed is None
    assert_matches(out, ref, max_ulp=2)
    assert torch.equal(x, x_before)


def test_rms_norm_keeps_leading_dims() -> None:
    norm = RMSNorm(100).to(DEVICE)
    x = rand(2, 3, 100, dtype=torch.float32, seed=4)
    out, _ = triton_ops.rms_norm(x, norm.weight, norm.eps)
    assert out.shape == x.shape
    assert_matches(out, norm.forward_native(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "head_dim,rotary_dim,num_heads,num_kv_heads",
    [(64, 64, 6, 2), (64, 32, 4, 4), (96, 96, 5, 1), (64, 24, 3, 1)],
)
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, head_dim: int, rotary_dim: int,
                                      num_heads: int, num_kv_heads: int) -> None:
    max_pos, tokens = 300, 9
    rope = RotaryEmbedding(head_dim, rotary_dim, max_pos, ROPE).to(DEVICE)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = rand(tokens, q_size + 2 * kv_size, dtype=dtype, seed=5, scale=2.0)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided row views
    g = torch.Generator().manual_seed(6)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    positions[0], positions[-1] = 0, max_pos - 1
    positions = positions.to(DEVICE)
    ref_q, ref_k = rope.forward_native(positions, q, k)
    v_before = v.clone()

    triton_ops.rotary_(q, k, positions, rope.cos_cache, rope.sin_cache, head_dim)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(v, v_before)  # nothing written past k
    if rotary_dim < head_dim:  # the tail of every head stays as it was
        assert torch.equal(q.view(tokens, num_heads, head_dim)[..., rotary_dim:],
                           ref_q.view(tokens, num_heads, head_dim)[..., rotary_dim:])


def test_rotary_int32_positions_and_empty_batch() -> None:
    rope = RotaryEmbedding(32, 32, 64, ROPE).to(DEVICE)
    q = rand(3, 64, dtype=torch.float32, seed=7)
    k = rand(3, 32, dtype=torch.float32, seed=8)
    positions = torch.tensor([5, 0, 63], dtype=torch.int32, device=DEVICE)
    ref_q, ref_k = rope.forward_native(positions.long(), q, k)
    triton_ops.rotary_(q, k, positions, rope.cos_cache, rope.sin_cache, 32)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    empty = q[:0]
    triton_ops.rotary_(empty, k[:0], positions[:0], rope.cos_cache, rope.sin_cache, 32)


def test_rotary_position_outside_the_table_is_nan_not_a_read_past_it() -> None:
    # The tables are views of a longer one, so a read past them lands on finite rows.
    rope = RotaryEmbedding(32, 32, 128, ROPE).to(DEVICE)
    cos, sin = rope.cos_cache[:64], rope.sin_cache[:64]
    q = rand(3, 64, dtype=torch.float32, seed=9)
    k = rand(3, 32, dtype=torch.float32, seed=10)
    positions = torch.tensor([7, 64, 100], device=DEVICE)
    ref_q, ref_k = rope.forward_native(positions, q, k)
    triton_ops.rotary_(q, k, positions, cos, sin, 32)
    assert_matches(q[:1], ref_q[:1])
    assert_matches(k[:1], ref_k[:1])
    assert q[1:].isnan().all() and k[1:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [100, 576, 1500])
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    # Strided rows, and d > the kernel's column block (1500) so a row spans two programs.
    x = rand(6, 2 * d + 16, dtype=dtype, seed=9, scale=3.0)[:, :2 * d]
    out = triton_ops.silu_and_mul(x)
    assert_matches(out, SiluAndMul.forward_native(x), max_ulp=2)


def test_silu_and_mul_keeps_leading_dims() -> None:
    x = rand(2, 3, 2 * 100, dtype=torch.bfloat16, seed=10, scale=3.0)
    out = triton_ops.silu_and_mul(x)
    assert out.shape == (2, 3, 100)
    assert_matches(out, SiluAndMul.forward_native(x), max_ulp=2)


def test_bfloat16_rounding_is_nearest_even() -> None:
    # gate * 1 with silu(gate) landing between two bf16 values: truncation and round-to-nearest
    # disagree on about half of these, so this fails if a cast truncates (the interpreter's does).
    gate = torch.linspace(-4, 4, 257).to(torch.bfloat16)
    x = torch.cat([gate, torch.ones_like(gate)]).view(1, -1).to(DEVICE)
    out = triton_ops.silu_and_mul(x)
    ref = SiluAndMul.forward_native(x)
    assert ulp_distance(out.cpu(), ref.cpu()).max().item() <= 1
    assert (out != ref).float().mean().item() <= 0.02


def test_supports() -> None:
    x = torch.zeros(4, 8)
    assert triton_ops.supports(x, torch.zeros(8))
    assert not triton_ops.supports(x, torch.zeros(8, dtype=torch.bfloat16))  # mixed dtypes
    assert not triton_ops.supports(x.t())  # last dim strided
    assert not triton_ops.supports(x.double())
