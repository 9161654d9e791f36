"""The grouped Triton MoE GEMM (pagellm/layers/triton_moe.py) against FusedMoE's torch path.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors, on tiny shapes: float
experts through ``fused_experts`` directly, quantized ones (int8, int4) through the layer with
the "triton" backend (the CUDA path), against the same layer's "torch" backend, which dequantizes
the same codes and runs the torch grouped path. Also the block alignment's layout.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from pagellm.layers import triton_moe  # noqa: E402
from pagellm.layers.fused_moe import FusedMoE, route  # noqa: E402
from pagellm.layers.quantization import parse_quantization  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, K, H, INTER = 6, 2, 64, 32


def _layer(seed: int = 0, num_experts: int = E) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(num_experts, K, H, INTER, renormalize=True)
    moe.w13_weight.data.copy_(torch.randn(moe.w13_weight.shape, generator=g) * 0.2)
    moe.w2_weight.data.copy_(torch.randn(moe.w2_weight.shape, generator=g) * 0.2)
    return moe.to(DEVICE)


def _inputs(tokens: int, seed: int = 1, num_experts: int = E):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(DEVICE)
    return x, torch.randn(tokens, num_experts, generator=g).to(DEVICE)


@pytest.mark.parametrize("tokens,num_experts,block_m", [(1, 6, 16), (13, 6, 16), (40, 3, 16),
                                                        (9, 8, 64)])
def test_align_block_size_layout(tokens, num_experts, block_m):
    ids = torch.randint(0, num_experts, (tokens, K), generator=torch.Generator().manual_seed(3))
    sorted_ids, expert_ids, num_rows = triton_moe.moe_align_block_size(ids, num_experts, block_m)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(num_rows) == int(padded.sum()) <= sorted_ids.numel()
    assert sorted_ids.numel() == expert_ids.numel() * block_m
    start = 0
    for e in range(num_experts):
        rows = sorted_ids[start:start + int(padded[e])]
        valid = rows[rows < flat.numel()]
        # Every assignment of expert e, in flat order (stable), then padding.
        assert valid.tolist() == (flat == e).nonzero().flatten().tolist()
        assert (rows[len(valid):] == flat.numel()).all()
        blocks = expert_ids[start // block_m:(start + int(padded[e])) // block_m]
        assert (blocks == e).all()
        start += int(padded[e])


@pytest.mark.parametrize("tokens", [1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_matches_torch_path(tokens, dtype):
    """40 tokens x top-2 over 6 experts averages over 13 rows per expert: BLOCK_M 16 with
    padding; a 2-expert layer with 40 tokens takes BLOCK_M 64."""
    for num_experts in (E, 2) if tokens == 40 else (E,):
        moe = _layer(num_experts=num_experts).to(dtype)
        x, logits = _inputs(tokens, num_experts=num_experts)
        x = x.to(dtype)
        weights, ids = route(logits, K, True, dtype)
        out = triton_moe.fused_experts(x, triton_moe.ExpertWeight(moe.w13_weight),
                                       triton_moe.ExpertWeight(moe.w2_weight), weights, ids)
        ref = moe._forward_grouped(x, weights, ids)
        assert out.dtype == dtype and out.shape == ref.shape
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        else:  # each projection rounded to bf16 as the torch path does; top-k summed in fp32
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_no_tokens():
    moe = _layer()
    ids = torch.zeros(0, K, dtype=torch.long, device=DEVICE)
    out = triton_moe.fused_experts(torch.zeros(0, H, device=DEVICE),
                                   triton_moe.ExpertWeight(moe.w13_weight),
                                   triton_moe.ExpertWeight(moe.w2_weight),
                                   torch.zeros(0, K, device=DEVICE), ids)
    assert out.shape == (0, H)


@pytest.mark.parametrize("spec", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [3, 40])
def test_quantized_experts_dequantize_in_kernel(spec, tokens):
    """The layer's Triton path (codes dequantized in the K loop) against the torch backend on
    the same codes (identical quantization: both use the plain layout)."""
    config = parse_quantization(spec)
    triton_layer, torch_layer = _layer(), _layer()
    assert triton_layer.quantize_(config, "triton") == torch_layer.quantize_(config, "torch")
    state = dict(triton_layer.named_parameters())
    for name, p in torch_layer.named_parameters():
        assert torch.equal(p, state[name]), name
    x, logits = _inputs(tokens)
    calls = []
    real = triton_moe.fused_experts

    def spy(*args):
        calls.append(1)
        return real(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_moe, "fused_experts", spy)
        out = triton_layer(x, logits)
    assert calls, "the triton backend did not take the grouped kernel"
    torch.testing.assert_close(out, torch_layer(x, logits), atol=1e-5, rtol=1e-5)
