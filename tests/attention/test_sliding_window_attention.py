"""Sliding-window attention, logit soft-capping and a non-default scale in every backend (torch,
cpu, triton under TRITON_INTERPRET=1) vs a dense float64 reference written here.

Blocks that lie wholly before a sequence's window are "freed" the way the KV cache manager frees
them: their block-table entries point at a NaN-filled block, so a backend that reads below the
window poisons its output.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from pagellm.attention.backend import AttentionMetadata  # noqa: E402
from pagellm.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from pagellm.attention.torch_backend import TorchAttentionBackend, causal_attention  # noqa: E402

# (context_len, query_len): decodes far past, at and inside the window, chunks with context
# straddling the window, fresh prompts longer and shorter than it.
SEQS = [(50, 1), (16, 1), (9, 1), (40, 13), (20, 5), (0, 37), (0, 6), (31, 1)]


class WindowCase:
    def __init__(self, window, soft_cap, block_size=8, num_heads=4, num_kv_heads=2,
                 head_dim=16, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.window, self.soft_cap, self.dtype = window, soft_cap, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = 0.7 / head_dim**0.5  # not 1/sqrt(D): Gemma's query_pre_attn_scalar
        seq_lens = [c + q for c, q in SEQS]
        blocks = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(blocks) + 2
        ids = list(range(1, num_blocks))
        random.Random(seed).shuffle(ids)
        freed = 0  # the block every freed table entry names: never written, NaN
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.k = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
        self.v = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
        self.q = [torch.randn(q, num_heads, head_dim, generator=g).to(dtype) for _, q in SEQS]
        tables, slots = [], []
        for (ctx, _), n, nb, k, v in zip(SEQS, seq_lens, blocks, self.k, self.v, strict=True):
            first_needed = max(ctx - window + 1, 0) if window else 0
            table = [freed if (b + 1) * block_size <= first_needed else ids.pop()
                     for b in range(nb)]
            tables.append(table)
            kept = first_needed // block_size * block_size  # a block partly in the window stays
            for pos in range(kept, n):
                blk, off = table[pos // block_size], pos % block_size
                if pos < ctx:
                    self.k_cache[blk, off], self.v_cache[blk, off] = k[pos], v[pos]
                else:
                    slots.append(blk * block_size + off)
        width = max(blocks) + 1
        starts = [0]
        for _, q in SEQS:
            starts.append(starts[-1] + q)
        self.meta = AttentionMetadata(
            num_tokens=starts[-1], num_seqs=len(SEQS),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [freed] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            max_query_len=max(q for _, q in SEQS), max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            is_decode_only=False)

    def inputs(self):
        key = torch.cat([k[c:] for k, (c, _) in zip(self.k, SEQS, strict=True)])
        value = torch.cat([v[c:] for v, (c, _) in zip(self.v, SEQS, strict=True)])
        return torch.cat(self.q), key, value

    def reference(self) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        outs = []
        for (ctx, q_len), q, k, v in zip(SEQS, self.q, self.k, self.v, strict=True):
            k = k.double().repeat_interleave(group, dim=1)
            v = v.double().repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", q.double(), k) * self.scale
            if self.soft_cap:
                s = torch.tanh(s / self.soft_cap) * self.soft_cap
            q_pos = ctx + torch.arange(q_len)[:, None]
            k_pos = torch.arange(ctx + q_len)[None, :]
            ok = k_pos <= q_pos
            if self.window:
                ok &= k_pos > q_pos - self.window
            outs.append(torch.einsum("hqk,khd->qhd", s.masked_fill(~ok, float("-inf"))
                                     .softmax(-1), v))
        return torch.cat(outs)


def _backend(name: str, case: WindowCase):
    args = (case.num_heads, case.head_dim, case.num_kv_heads, case.scale, case.window,
            case.soft_cap)
    if name == "triton":
        pytest.importorskip("triton")
        from pagellm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(*args)
    return {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend}[name](*args)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("window,soft_cap", [(16, None), (7, 5.0), (None, 2.0), (64, None)])
def test_window_and_soft_cap_match_reference(backend, window, soft_cap):
    case = WindowCase(window, soft_cap)
    query, key, value = case.inputs()
    out = _backend(backend, case).forward(query, key, value, case.k_cache, case.v_cache,
                                          case.meta)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), case.reference(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_only_window_batch(backend):
    """The batched decode path (one SDPA over all decodes) with per-row window offsets."""
    case = WindowCase(12, 3.0, seed=4)
    decode = [i for i, (_, q) in enumerate(SEQS) if q == 1]
    keep_q = [case.q[i] for i in decode]
    rows = torch.tensor([case.meta.query_start_loc_cpu[i] for i in decode])
    query, key, value = case.inputs()
    out = _backend(backend, case).forward(query, key, value, case.k_cache, case.v_cache,
                                          case.meta)
    ref = case.reference()
    torch.testing.assert_close(out[rows].double(), ref[rows], atol=1e-4, rtol=1e-4)
    assert len(keep_q) == len(decode)


def test_causal_attention_without_cache_windows_and_caps():
    torch.manual_seed(0)
    q, k, v = torch.randn(20, 4, 8), torch.randn(20, 2, 8), torch.randn(20, 2, 8)
    out = causal_attention(q, k, v, 0.3, sliding_window=5, soft_cap=4.0)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = torch.tanh(torch.einsum("qhd,khd->hqk", q.double(), kk) * 0.3 / 4.0) * 4.0
    pos = torch.arange(20)
    ok = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - 5)
    ref = torch.einsum("hqk,khd->qhd", s.masked_fill(~ok, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
