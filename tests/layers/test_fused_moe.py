"""FusedMoE's grouped forward against a per-token reference, its routing (renormalized or not),
the capture-time dense path, and the weight loader's per-rank slices of each expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.distributed import parallel_state
from pagellm.layers.fused_moe import FusedMoE, SparseMoeBlock, route

E, K, H, INTER = 6, 2, 16, 8


def _experts(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(INTER, H, generator=g), torch.randn(INTER, H, generator=g),
             torch.randn(H, INTER, generator=g)) for _ in range(E)]


def _layer(experts, renormalize: bool = True) -> FusedMoE:
    moe = FusedMoE(E, K, H, INTER, renormalize)
    for e, (w1, w3, w2) in enumerate(experts):
        for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            param = moe.w2_weight if name == "w2" else moe.w13_weight
            moe.weight_loader(param, w, (e, name))
    return moe


def _reference(x, logits, experts, renormalize: bool) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        w, ids = probs[t].topk(K)
        if renormalize:
            w = w / w.sum()
        for weight, e in zip(w.tolist(), ids.tolist(), strict=True):
            w1, w3, w2 = experts[e]
            out[t] += weight * (F.silu(x[t] @ w1.T) * (x[t] @ w3.T)) @ w2.T
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_grouped_forward_matches_per_token_reference(renormalize, tokens):
    experts = _experts()
    moe = _layer(experts, renormalize)
    x, logits = torch.randn(tokens, H), torch.randn(tokens, E)
    expected = _reference(x, logits, experts, renormalize)
    torch.testing.assert_close(moe(x, logits), expected, atol=1e-4, rtol=1e-5)
    # The path taken while a CUDA graph is captured (no host-side counts) agrees.
    weights, ids = route(logits, K, renormalize, x.dtype)
    torch.testing.assert_close(moe._forward_dense(x, weights, ids), expected, atol=1e-4,
                               rtol=1e-5)


def test_route_matches_transformers_and_casts():
    logits = torch.randn(7, E, dtype=torch.bfloat16)
    weights, ids = route(logits, K, True, torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    top, top_ids = probs.topk(K)
    assert weights.dtype == torch.bfloat16 and torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, (top / top.sum(-1, keepdim=True)).bfloat16())


def test_unused_experts_and_bfloat16():
    """Logits that pick only experts 1 and 4: the others get no rows and are skipped."""
    experts = _experts(1)
    moe = _layer(experts).to(torch.bfloat16)
    logits = torch.full((9, E), -10.0)
    logits[:, 1], logits[:, 4] = 3.0, 2.0
    x = torch.randn(9, H)
    out = moe(x.bfloat16(), logits.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(x, logits, experts, True), atol=0.5,
                               rtol=0.05)


@pytest.mark.parametrize("rank", [0, 1])
def test_weight_loader_takes_this_ranks_slice(monkeypatch, rank):
    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
    monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
    experts = _experts()
    moe = _layer(experts)
    half = INTER // 2
    assert moe.w13_weight.shape == (E, 2 * half, H) and moe.w2_weight.shape == (E, H, half)
    rows = slice(rank * half, (rank + 1) * half)
    for e, (w1, w3, w2) in enumerate(experts):
        assert torch.equal(moe.w13_weight[e, :half], w1[rows])
        assert torch.equal(moe.w13_weight[e, half:], w3[rows])
        assert torch.equal(moe.w2_weight[e], w2[:, rows])


def test_loader_refuses_partial_tensors_and_bad_shards():
    moe = FusedMoE(E, K, H, INTER, True)
    with pytest.raises(ValueError, match="whole, unsharded w1"):
        moe.weight_loader(moe.w13_weight, torch.zeros(INTER // 2, H), (0, "w1"))
    with pytest.raises(ValueError, match="no expert shard"):
        moe.weight_loader(moe.w13_weight, torch.zeros(INTER, H), (E, "w1"))
    with pytest.raises(ValueError, match="not divisible"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(parallel_state, "_TP_SIZE", 3)
            FusedMoE(E, K, H, INTER, True)


def test_block_routes_with_its_replicated_router():
    block = SparseMoeBlock(E, K, H, INTER, renormalize=True)
    experts = _experts()
    block.experts = _layer(experts)
    torch.nn.init.normal_(block.gate.weight)
    x = torch.randn(4, H)
    expected = _reference(x, x @ block.gate.weight.T, experts, True)
    torch.testing.assert_close(block(x), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_block_is_bit_identical_to_transformers(family):
    """Same weights, float32: transformers' sparse MoE block (its own expert loop) and ours agree
    to the bit (routing in float32, experts' sums in ascending expert order)."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    if family == "mixtral":
        ref = MixtralSparseMoeBlock(MixtralConfig(hidden_size=H, intermediate_size=INTER,
                                                  num_local_experts=E, num_experts_per_tok=K))
        renormalize = True
    else:
        ref = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER,
                                                    num_experts=E, num_experts_per_tok=K,
                                                    norm_topk_prob=False))
        renormalize = False
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = SparseMoeBlock(E, K, H, INTER, renormalize)
    ours.gate.weight.data.copy_(ref.gate.weight)
    ours.experts.w13_weight.data.copy_(ref.experts.gate_up_proj)  # gate rows, then up rows
    ours.experts.w2_weight.data.copy_(ref.experts.down_proj)
    x = torch.randn(1, 200, H)
    with torch.no_grad():
        expected = ref(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert torch.equal(ours(x[0]), expected[0])
