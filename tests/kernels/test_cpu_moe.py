"""The fused CPU MoE kernel (kernels/cpu_moe.cpp) against a float64 per-token reference and
FusedMoE's torch path, over the shapes that take its odd paths: experts with no rows, one row or
every row, top-k 1/2/8, expert counts and widths that fill no whole panel, 1..600 tokens; its
layouts' round trip; a token's sum independent of the thread count; TP shards; weight updates of
packed experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_moe, cpu_ops
from pagellm.layers.fused_moe import FusedMoE, prepack_experts_for_cpu, route

pytestmark = [pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler"),
              pytest.mark.usefixtures("cpu_isa")]


def _moe(e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int = 0) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(e, k, h, i, renormalize=True, params_dtype=dtype)
    moe.w13_weight.data.copy_(torch.randn(e, 2 * i, h, generator=g) * h ** -0.5)
    moe.w2_weight.data.copy_(torch.randn(e, h, i, generator=g) * i ** -0.5)
    return moe


def _reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor) -> torch.Tensor:
    """float64, token by token, experts in ascending order."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    i = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in sorted(zip(ids[t].tolist(), weights[t].double().tolist(), strict=True)):
            gate, up = x[t] @ w13[e, :i].T, x[t] @ w13[e, i:].T
            out[t] += w * ((F.silu(gate) * up) @ w2[e].T)
    return out


def _skip_unless_supported(dtype: torch.dtype, h: int, i: int) -> None:
    if not cpu_moe.supports(dtype, h, i):
        pytest.skip(f"this kernel build has no fused MoE path for {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,top_k,hidden,inter,tokens", [
    (4, 1, 32, 16, 1),      # one row, one pair block, one down block
    (6, 2, 64, 48, 5),      # an odd number of pair blocks
    (5, 2, 48, 32, 37),     # E not a multiple of anything; three down blocks
    (128, 8, 64, 32, 33),   # most experts get no rows or one
    (8, 8, 80, 16, 600),    # every expert gets every row; chunks of 256 rows
])
def test_fused_matches_float64_reference(dtype, experts, top_k, hidden, inter, tokens):
    _skip_unless_supported(dtype, hidden, inter)
    moe = _moe(experts, top_k, hidden, inter, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, True, dtype)
    expected = _reference(x, weights, ids, moe.w13_weight.data, moe.w2_weight.data)
    torch_path = moe._forward_grouped(x, weights, ids)
    p13, p2 = cpu_moe.pack_experts(moe.w13_weight.data, moe.w2_weight.data)
    out = cpu_moe.moe_forward(x, weights, ids, p13, p2, inter)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, torch_path, atol=1e-5, rtol=1e-5)
    else:
        # One rounding of the sum against the torch path's per-product roundings.
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
        err = (out.double() - expected).abs().mean()
        assert err <= (torch_path.double() - expected).abs().mean() * 1.5 + 1e-4


def test_experts_without_rows_and_a_row_slice_of_x():
    """Only experts 1 and 3 are picked; x is a strided view (rows of a wider buffer)."""
    _skip_unless_supported(torch.float32, 32, 16)
    moe = _moe(5, 2, 32, 16, torch.float32)
    wide = torch.randn(7, 48)
    x = wide[:, 8:40]
    ids = torch.tensor([[1, 3]] * 7)
    weights = torch.rand(7, 2)
    p13, p2 = cpu_moe.pack_experts(moe.w13_weight.data, moe.w2_weight.data)
    out = cpu_moe.moe_forward(x, weights, ids, p13, p2, 16)
    torch.testing.assert_close(out.double(), _reference(x, weights, ids, moe.w13_weight.data,
                                                         moe.w2_weight.data),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_round_trip(dtype):
    moe = _moe(3, 1, 64, 48, dtype)
    p13, p2 = cpu_moe.pack_experts(moe.w13_weight.data, moe.w2_weight.data)
    assert p13.numel() == moe.w13_weight.numel() and p2.numel() == moe.w2_weight.numel()
    w13, w2 = cpu_moe.unpack_experts(p13, p2, 64, 48)
    assert torch.equal(w13, moe.w13_weight.data) and torch.equal(w2, moe.w2_weight.data)


def test_sum_does_not_depend_on_thread_count():
    _skip_unless_supported(torch.float32, 64, 32)
    moe = _moe(16, 4, 64, 32, torch.float32)
    x = torch.randn(50, 64)
    weights, ids = route(torch.randn(50, 16), 4, True, torch.float32)
    p13, p2 = cpu_moe.pack_experts(moe.w13_weight.data, moe.w2_weight.data)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_moe.moe_forward(x, weights, ids, p13, p2, 32))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_expert_id_out_of_range_is_refused():
    _skip_unless_supported(torch.float32, 32, 16)
    moe = _moe(4, 2, 32, 16, torch.float32)
    p13, p2 = cpu_moe.pack_experts(moe.w13_weight.data, moe.w2_weight.data)
    with pytest.raises(IndexError, match="outside 0..3"):
        cpu_moe.moe_forward(torch.randn(2, 32), torch.rand(2, 2), torch.tensor([[0, 4], [1, 2]]),
                            p13, p2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_packs_forwards_and_unpacks_for_updates(dtype):
    """FusedMoE after prepack: the same outputs as its torch path (float32: within 1e-5), the
    float stacks gone; a weight update's float layout gives back the stacks bit for bit, and
    packing again serves the new weights."""
    moe = _moe(6, 2, 64, 32, dtype)
    x, logits = torch.randn(9, 64).to(dtype), torch.randn(9, 6).to(dtype)
    before = moe(x, logits)
    w13, w2 = moe.w13_weight.data.clone(), moe.w2_weight.data.clone()
    if not prepack_experts_for_cpu(moe):
        assert not cpu_moe.supports(dtype, 64, 32)
        return
    assert moe.cpu_packed and not hasattr(moe, "w13_weight")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(moe(x, logits), before, **tol)
    moe.to_float_layout()
    assert torch.equal(moe.w13_weight.data, w13) and torch.equal(moe.w2_weight.data, w2)
    moe.weight_loader(moe.w2_weight, torch.zeros(64, 32, dtype=dtype), (0, "w2"))
    assert moe.process_weights_after_loading() and moe.cpu_packed
    w2[0] = 0
    expected = _reference(x, *route(logits, 2, True, dtype), w13, w2)
    torch.testing.assert_close(moe(x, logits).double(), expected, **tol)


def test_tensor_parallel_shards_sum_to_the_whole(monkeypatch):
    """Two ranks' packed shards (each half of every expert's width) add up to the whole MLP,
    as the all-reduce adds them."""
    _skip_unless_supported(torch.float32, 64, 32)
    from pagellm.distributed import parallel_state

    whole = _moe(5, 2, 64, 64, torch.float32)
    x = torch.randn(11, 64)
    weights, ids = route(torch.randn(11, 5), 2, True, torch.float32)
    expected = _reference(x, weights, ids, whole.w13_weight.data, whole.w2_weight.data)
    total = torch.zeros(11, 64)
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "get_tp_rank", lambda r=rank: r)
        monkeypatch.setattr(parallel_state, "get_tp_size", lambda: 2)
        monkeypatch.setattr("pagellm.layers.fused_moe.get_tp_rank", lambda r=rank: r)
        monkeypatch.setattr("pagellm.layers.fused_moe.get_tp_size", lambda: 2)
        shard = FusedMoE(5, 2, 64, 64, renormalize=True, params_dtype=torch.float32)
        for e in range(5):
            shard.weight_loader(shard.w13_weight, whole.w13_weight.data[e, :64], (e, "w1"))
            shard.weight_loader(shard.w13_weight, whole.w13_weight.data[e, 64:], (e, "w3"))
            shard.weight_loader(shard.w2_weight, whole.w2_weight.data[e], (e, "w2"))
        assert prepack_experts_for_cpu(shard)
        total += shard.cpu.forward(shard, x, weights, ids)
    torch.testing.assert_close(total.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_through_the_fused_kernel(dtype, method):
    """Weight-only int8 / int4 experts (the "cpu" backend's codes and scales) packed for the
    kernel: outputs as the dequantized weights give them (float64 reference; bfloat16 within its
    rounding, no worse than the per-expert path it replaces); unpacking for an update gives back
    the method's parameters bit for bit."""
    from pagellm.layers.quantization import QuantConfig

    _skip_unless_supported(dtype, 64, 32)
    moe = _moe(8, 2, 64, 32, dtype)
    moe.quantize_(QuantConfig(method, 32 if method == "int4" else 0), backend="cpu")
    x, logits = torch.randn(13, 64).to(dtype), torch.randn(13, 8).to(dtype)
    weights, ids = route(logits, 2, True, dtype)
    per_expert = moe(x, logits)
    before = {n: p.data.clone() for n, p in moe.named_parameters()}
    w13 = torch.stack([moe.quant.dequantize(moe, "w13", e) for e in range(8)])
    w2 = torch.stack([moe.quant.dequantize(moe, "w2", e) for e in range(8)])
    expected = _reference(x, weights, ids, w13, w2)
    assert prepack_experts_for_cpu(moe) and not hasattr(moe, "w13_qweight")
    assert moe.w13_packed.dtype == (torch.int8 if method == "int8" else torch.uint8)
    out = moe(x, logits)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
        err = (out.double() - expected).abs().mean()
        assert err <= (per_expert.double() - expected).abs().mean() * 1.5 + 1e-4
    moe.to_float_layout()
    assert not moe.cpu_packed and hasattr(moe, "w13_weight")
    moe.process_weights_after_loading()  # nothing loaded: the same codes, packed again
    assert moe.cpu_packed
    torch.testing.assert_close(moe(x, logits), out, atol=0, rtol=0)
    moe.cpu.unpack(moe)
    assert {n: p.data for n, p in moe.named_parameters()}.keys() == before.keys()
    for name, t in before.items():
        assert torch.equal(getattr(moe, name).data, t), name


def test_int4_group_must_divide_the_shapes():
    _skip_unless_supported(torch.bfloat16, 64, 32)
    p13 = torch.zeros(2, 64 * 32, dtype=torch.uint8)
    p2 = torch.zeros(2, 32 * 32, dtype=torch.uint8)
    sz = torch.zeros(2, 1, 64, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group 48"):
        cpu_moe.moe_forward(torch.randn(1, 64).bfloat16(), torch.ones(1, 1), torch.zeros(1, 1),
                            p13, p2, 32, sz, sz, group=48)
