"""Paged batches over an 8-bit KV cache, and their float64 reference, for the attention tests
(test_kv_quant.py, test_triton_kv_quant.py).

Block tables use shuffled block ids; the slots nobody wrote hold 0x7f bytes (NaN in fp8, 127
in int8, whose bfloat16 scales are NaN), so reading outside a sequence poisons the output.
"""

from __future__ import annotations

import math
import random

import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.kv_quant import (
    SCALE_DTYPE,
    KVQuant,
    dequantize,
    quantize,
    storage_dtype,
    write_kv_quant,
)

KINDS = ("fp8_e4m3", "fp8_e5m2", "int8_per_token_head")
# (context_len, query_len): decode tokens, prefill chunks with and without context.
MIXED = [(37, 1), (20, 13), (0, 25), (15, 1), (0, 1), (32, 17)]


def make_quant(kind: str, num_slots: int, kv_heads: int, k_scale: float = 1.0,
           v_scale: float = 1.0) -> KVQuant:
    scales = None
    if kind == "int8_per_token_head":
        scales = torch.full((2, num_slots, kv_heads), float("nan"), dtype=SCALE_DTYPE)
    return KVQuant(kind, k_scale, v_scale, None if scales is None else scales[0],
                   None if scales is None else scales[1])


class QuantCase:
    """Sequences whose context K/V are in a quantized cache; new tokens run through forward."""

    def __init__(self, seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, kind,
                 seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.dtype, self.num_heads = seqs, dtype, num_heads
        seq_lens = [c + q for c, q in seqs]
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
        ids = list(range(num_blocks))
        random.Random(seed).shuffle(ids)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, 0x7F, dtype=storage_dtype(kind))
        self.v_cache = torch.full(shape, 0x7F, dtype=storage_dtype(kind))
        self.quant = make_quant(kind, num_blocks * block_size, num_kv_heads, 0.75, 1.5)
        if self.quant.k_scales is not None:
            self.quant.k_scales = self.quant.k_scales.view(num_blocks, block_size, -1)
            self.quant.v_scales = self.quant.v_scales.view(num_blocks, block_size, -1)
        self.k = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
        self.v = [torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype) for n in seq_lens]
        self.q = [torch.randn(q, num_heads, head_dim, generator=g).to(dtype) for _, q in seqs]
        tables, slots, ctx_slots, ctx_k, ctx_v = [], [], [], [], []
        for (ctx, _), n, k, v in zip(seqs, seq_lens, self.k, self.v, strict=True):
            table = [ids.pop() for _ in range(-(-n // block_size))]
            tables.append(table)
            pos_slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
            ctx_slots += pos_slots[:ctx]
            ctx_k.append(k[:ctx])
            ctx_v.append(v[:ctx])
            slots += pos_slots[ctx:]
        write_kv_quant(torch.cat(ctx_k), torch.cat(ctx_v), self.k_cache, self.v_cache,
                       torch.tensor(ctx_slots), self.quant)
        width = max(len(t) for t in tables) + 2
        starts = [0]
        for _, q in seqs:
            starts.append(starts[-1] + q)
        self.meta = AttentionMetadata(
            num_tokens=starts[-1], num_seqs=len(seqs),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            max_query_len=max(q for _, q in seqs), max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            is_decode_only=all(q == 1 for _, q in seqs))

    def to(self, device) -> QuantCase:
        """The same batch on ``device`` (the Triton tests on CUDA)."""
        self.k_cache, self.v_cache = self.k_cache.to(device), self.v_cache.to(device)
        for name in ("k_scales", "v_scales"):
            t = getattr(self.quant, name)
            setattr(self.quant, name, None if t is None else t.to(device))
        self.k, self.v, self.q = ([t.to(device) for t in ts] for ts in (self.k, self.v, self.q))
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            setattr(self.meta, name, getattr(self.meta, name).to(device))
        return self

    def run(self, backend):
        key = torch.cat([k[c:] for k, (c, _) in zip(self.k, self.seqs, strict=True)])
        value = torch.cat([v[c:] for v, (c, _) in zip(self.v, self.seqs, strict=True)])
        return backend.forward(torch.cat(self.q), key, value, self.k_cache, self.v_cache,
                               self.meta, kv_quant=self.quant)

    def reference(self, scale, window=None, soft_cap=None):
        """float64 attention over dequantize(quantize(K/V)) of each sequence, computed here."""
        outs = []
        for (ctx, ql), k, v, q in zip(self.seqs, self.k, self.v, self.q, strict=True):
            k, v, q = k.cpu(), v.cpu(), q.cpu()
            kd = dequantize(*quantize(k, self.quant, "k"), self.quant, "k").double()
            vd = dequantize(*quantize(v, self.quant, "v"), self.quant, "v").double()
            rep = q.shape[1] // k.shape[1]
            kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
            s = torch.einsum("qhd,khd->hqk", q.double(), kd) * scale
            if soft_cap is not None:
                s = soft_cap * torch.tanh(s / soft_cap)
            qpos = torch.arange(ctx, ctx + ql)[:, None]
            kpos = torch.arange(ctx + ql)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            s = s.masked_fill(~mask, -math.inf)
            outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd))
        return torch.cat(outs)
