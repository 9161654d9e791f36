"""The torch and cpu attention backends vs a dense float64 causal attention written here.

Block tables use shuffled, non-contiguous block ids; every cache slot nobody wrote holds NaN, so
reading a slot outside a sequence (padding, partial last block, padded block-table entries)
poisons the output.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.cpu_backend import CpuAttentionBackend
from pagellm.attention.registry import get_attn_backend_cls, set_default_backend
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.forward_context import set_forward_context
from pagellm.layers.attention import Attention

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
# (context_len, query_len): decode tokens, a prefill chunk with context, fresh prefills.
MIXED = [(37, 1), (20, 13), (0, 25), (15, 1), (31, 1), (0, 1), (32, 17), (0, 3)]


class Case:
    """Sequences with K/V already cached for their context; new tokens to run through forward."""

    def __init__(self, seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size, self.dtype = seqs, block_size, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        seq_lens = [c + q for c, q in seqs]
        need = sum(-(-n // block_size) for n in seq_lens)
        num_blocks = need + 5
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        # Full per-sequence K/V and queries, rounded to dtype once (the reference sees the same).
        self.k = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
        self.v = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
        self.q = [torch.randn(q, num_heads, head_dim, generator=g).to(dtype) for _, q in seqs]
        self.tables, slots = [], []
        for (ctx, _), n, k, v in zip(seqs, seq_lens, self.k, self.v, strict=True):
            table = [ids.pop() for _ in range(-(-n // block_size))]
            self.tables.append(table)
            for pos in range(n):
                blk, off = table[pos // block_size], pos % block_size
                if pos < ctx:  # context: already in the cache
                    self.k_cache[blk, off] = k[pos]
                    self.v_cache[blk, off] = v[pos]
                else:
                    slots.append(blk * block_size + off)
        width = max(len(t) for t in self.tables) + 2  # extra padded columns (block id 0)
        starts = [0]
        for _, q in seqs:
            starts.append(starts[-1] + q)
        self.meta = AttentionMetadata(
            num_tokens=starts[-1],
            num_seqs=len(seqs),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in self.tables],
                                      dtype=torch.int32),
            max_query_len=max(q for _, q in seqs),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            is_decode_only=all(q == 1 for _, q in seqs),
        )
        self.slots = slots

    def inputs(self):
        query = torch.cat(self.q)
        key = torch.cat([k[c:] for k, (c, _) in zip(self.k, self.seqs, strict=True)])
        value = torch.cat([v[c:] for v, (c, _) in zip(self.v, self.seqs, strict=True)])
        return query, key, value

    def reference(self) -> torch.Tensor:
        """Dense causal attention in float64, one sequence and one head at a time."""
        group = self.num_heads // self.num_kv_heads
        outs = []
        for (ctx, q_len), q, k, v in zip(self.seqs, self.q, self.k, self.v, strict=True):
            q, k, v = q.double(), k.double(), v.double()
            out = torch.empty_like(q)
            for h in range(self.num_heads):
                scores = q[:, h] @ k[:, h // group].T / math.sqrt(self.head_dim)
                for i in range(q_len):
                    scores[i, ctx + i + 1 :] = float("-inf")
                out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
            outs.append(out)
        return torch.cat(outs)


BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}


def _run(case: Case, backend_name: str = "torch") -> torch.Tensor:
    backend = BACKENDS[backend_name](case.num_heads, case.head_dim, case.num_kv_heads,
                                    1 / math.sqrt(case.head_dim))
    query, key, value = case.inputs()
    out = backend.forward(query, key, value, case.k_cache, case.v_cache, case.meta)
    assert out.shape == query.shape and out.dtype == case.dtype
    return out


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_mixed_batch_matches_dense_reference(backend, dtype, block_size, num_heads,
                                             num_kv_heads):
    case = Case(MIXED, block_size, num_heads, num_kv_heads, 32, dtype)
    out = _run(case, backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), case.reference(), **TOL[dtype])
    # The new K/V landed exactly in their slots.
    _, key, value = case.inputs()
    torch.testing.assert_close(case.k_cache.view(-1, num_kv_heads, 32)[case.slots], key,
                               atol=0, rtol=0)
    torch.testing.assert_close(case.v_cache.view(-1, num_kv_heads, 32)[case.slots], value,
                               atol=0, rtol=0)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3)])
def test_decode_only_batch(backend, dtype, num_heads, num_kv_heads):
    seqs = [(0, 1), (15, 1), (16, 1), (47, 1), (5, 1), (300, 1)]  # both sides of block edges
    case = Case(seqs, 16, num_heads, num_kv_heads, 64, dtype, seed=3)
    assert case.meta.is_decode_only
    out = _run(case, backend)
    torch.testing.assert_close(out.double(), case.reference(), **TOL[dtype])


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_decode_rows_found_without_decode_only_flag(backend):
    """is_decode_only is an optimisation hint: False with only decodes must still work."""
    case = Case([(9, 1), (40, 1)], 16, 4, 2, 32, torch.float32, seed=5)
    case.meta.is_decode_only = False
    torch.testing.assert_close(_run(case, backend).double(), case.reference(), **TOL[torch.float32])


def test_attention_layer_without_metadata_is_plain_causal():
    torch.manual_seed(0)
    layer = Attention(num_heads=4, head_dim=16, num_kv_heads=2, scale=0.25, layer_idx=0)
    q, k, v = torch.randn(9, 64), torch.randn(9, 32), torch.randn(9, 32)
    with set_forward_context(None, []):
        out = layer(q, k, v)
    qh, kh, vh = (t.view(9, -1, 16).double() for t in (q, k, v))
    kh, vh = kh.repeat_interleave(2, dim=1), vh.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qh, kh) * 0.25
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh).reshape(9, 64)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_attention_layer_uses_its_layer_cache():
    case = Case([(10, 1), (0, 6)], 16, 4, 2, 16, torch.float32, seed=7)
    layer = Attention(4, 16, 2, 0.25, layer_idx=1, backend_name="torch")
    other = torch.zeros_like(case.k_cache)
    query, key, value = case.inputs()
    n = case.meta.num_tokens
    with set_forward_context(case.meta, [(other, other.clone()), (case.k_cache, case.v_cache)]):
        out = layer(query.view(n, -1), key.view(n, -1), value.view(n, -1))
    assert (other == 0).all()
    torch.testing.assert_close(out.view(n, 4, 16).double(), case.reference(),
                               **TOL[torch.float32])


def test_registry():
    assert get_attn_backend_cls("torch", torch.device("cpu")) is TorchAttentionBackend
    assert get_attn_backend_cls("auto", torch.device("cpu")) is CpuAttentionBackend
    assert get_attn_backend_cls("cpu", torch.device("cpu")) is CpuAttentionBackend
    with pytest.raises(ValueError, match="attention backend"):
        get_attn_backend_cls("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention backend"):
        set_default_backend("nope")
