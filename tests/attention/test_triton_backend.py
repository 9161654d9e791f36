"""Triton paged attention vs a dense float64 causal reference written here.

Without CUDA the kernels run under TRITON_INTERPRET=1 (numpy on CPU tensors): shapes stay small
but every case class is covered — GQA ratios, mixed batches, partial blocks, block sizes 16/32,
several head dims, fp32/bf16, NaN in unused cache slots, key segments, padded tokens.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import
pytest.importorskip("triton")

from pagellm.attention import triton_kernels as tk  # noqa: E402
from pagellm.attention.backend import AttentionMetadata  # noqa: E402
from pagellm.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    choose_num_segments,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

# (context_len, query_len) per sequence: decode mid-block, decode opening a new block, a prefill
# chunk over paged context, a fresh partial-block prefill, a one-token prompt, a long chunk.
MIXED = [(37, 1), (31, 1), (20, 13), (0, 9), (0, 1), (15, 40)]


class Case:
    """A random paged batch: NaN-filled cache, shuffled block ids, context K/V pre-stored."""

    def __init__(self, seqs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size, self.dtype = seqs, block_size, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        blocks_per_seq = [math.ceil((c + q) / block_size) for c, q in seqs]
        num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
        perm = torch.randperm(num_blocks, generator=g).tolist()
        max_blocks = max(blocks_per_seq) + 1  # one extra padded column (0) on every row
        self.block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)

        def rand(*s):
            return torch.randn(*s, generator=g).to(dtype)

        self.k_full, self.v_full, self.slots = [], [], []
        for i, ((ctx, q), nb) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
            ids = [perm.pop() for _ in range(nb)]
            self.block_tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
            pos = torch.arange(ctx + q)
            slots = torch.tensor(ids)[pos // block_size] * block_size + pos % block_size
            k, v = rand(ctx + q, num_kv_heads, head_dim), rand(ctx + q, num_kv_heads, head_dim)
            self.k_cache.view(-1, num_kv_heads, head_dim)[slots[:ctx]] = k[:ctx]
            self.v_cache.view(-1, num_kv_heads, head_dim)[slots[:ctx]] = v[:ctx]
            self.k_full.append(k)
            self.v_full.append(v)
            self.slots.append(slots[ctx:])
        self.key = torch.cat([k[c:] for k, (c, _) in zip(self.k_full, seqs, strict=True)])
        self.value = torch.cat([v[c:] for v, (c, _) in zip(self.v_full, seqs, strict=True)])
        self.query = rand(self.key.shape[0], num_heads, head_dim)
        self.slot_mapping = torch.cat(self.slots)

    def meta(self) -> AttentionMetadata:
        qlens = [q for _, q in self.seqs]
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        seq_lens = [c + q for c, q in self.seqs]
        return AttentionMetadata(
            num_tokens=qsl[-1],
            num_seqs=len(self.seqs),
            slot_mapping=self.slot_mapping.to(DEVICE),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=self.block_tables.to(DEVICE),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            is_decode_only=all(q == 1 for q in qlens),
        )

    def reference(self) -> torch.Tensor:
        """Dense float64 causal attention of every sequence over its whole K/V."""
        outs, start = [], 0
        group = self.num_heads // self.num_kv_heads
        for (ctx, q), k, v in zip(self.seqs, self.k_full, self.v_full, strict=True):
            qs = self.query[start : start + q].double()
            start += q
            k = k.double().repeat_interleave(group, dim=1)
            v = v.double().repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", qs, k) * self.scale
            allowed = torch.arange(ctx + q)[None, :] <= (ctx + torch.arange(q))[:, None]
            p = s.masked_fill(~allowed, float("-inf")).softmax(-1)
            outs.append(torch.einsum("hqk,khd->qhd", p, v))
        return torch.cat(outs)

    def caches(self):
        # clone: on CPU .to() would hand back the very tensors the test compares against.
        return self.k_cache.clone().to(DEVICE), self.v_cache.clone().to(DEVICE)


def run_backend(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    backend = TritonAttentionBackend(
        case.num_heads, case.head_dim, case.num_kv_heads, case.scale
    )
    k_cache, v_cache = case.caches()
    out = backend.forward(
        case.query.to(DEVICE),
        case.key.to(DEVICE),
        case.value.to(DEVICE),
        k_cache,
        v_cache,
        case.meta(),
    )
    return out.cpu(), k_cache.cpu(), v_cache.cpu()


def assert_close(out: torch.Tensor, case: Case) -> None:
    assert out.dtype == case.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), case.reference(), **TOL[case.dtype])


def kernel_out(case: Case, **kw) -> torch.Tensor:
    """Run the store + attention kernels directly, with explicit tuning knobs."""
    meta = case.meta()
    k_cache, v_cache = case.caches()
    q = case.query.to(DEVICE)
    tk.reshape_and_cache(
        case.key.to(DEVICE), case.value.to(DEVICE), k_cache, v_cache, meta.slot_mapping
    )
    out = torch.empty_like(q)
    tk.paged_attention(
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.num_seqs, meta.max_query_len, case.scale, **kw,
    )  # fmt: skip
    return out.cpu()


@pytest.mark.parametrize(
    "block_size,num_heads,num_kv_heads,head_dim,dtype",
    [
        (16, 2, 2, 64, torch.float32),  # MHA (Hq == Hkv)
        (16, 4, 2, 32, torch.float32),  # GQA 2
        (32, 8, 2, 64, torch.bfloat16),  # GQA 4
        (32, 4, 1, 128, torch.bfloat16),  # GQA 4, one kv head, head_dim 128
        (16, 6, 2, 80, torch.float32),  # GQA 3, head_dim not a power of 2
    ],
)
def test_mixed_batch_matches_reference(block_size, num_heads, num_kv_heads, head_dim, dtype):
    case = Case(MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=block_size)
    out, k_cache, v_cache = run_backend(case)
    assert_close(out, case)
    # The new K/V landed in their slots, bit-exact.
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[case.slot_mapping], case.key)
    assert torch.equal(flat_v[case.slot_mapping], case.value)


@pytest.mark.parametrize("block_m,tile_size,block_size", [(16, 16, 32), (32, 64, 16), (16, 32, 8)])
def test_query_blocks_and_tiles_across_block_boundaries(block_m, tile_size, block_size):
    # Several query blocks per sequence; tiles smaller and larger than a cache block. (9, 16):
    # the first query block's last row needs key 16 exactly, the first key of a new tile.
    seqs = [(29, 21), (0, 35), (40, 1), (9, 16)]
    case = Case(seqs, block_size, 4, 2, 32, torch.float32, seed=3)
    assert_close(kernel_out(case, block_m=block_m, tile_size=tile_size), case)


@pytest.mark.parametrize("num_segments", [1, 4, 16])
def test_decode_key_segments(num_segments):
    # 16 segments leave some empty for the short sequences: they must weigh nothing.
    seqs = [(130, 1), (5, 1), (64, 1), (0, 1)]
    case = Case(seqs, 16, 4, 1, 64, torch.bfloat16, seed=7)
    assert_close(kernel_out(case, num_segments=num_segments), case)


def test_blocks_filled_in_the_same_step_are_readable():
    # Sequence 1 shares sequence 0's two full blocks, which sequence 0 fills in this very step.
    case = Case([(0, 32), (32, 5)], 16, 4, 2, 64, torch.float32, seed=11)
    shared = case.block_tables[0, :2].clone()
    case.block_tables[1, :2] = shared
    case.k_full[1][:32] = case.k_full[0]
    case.v_full[1][:32] = case.v_full[0]
    for cache in (case.k_cache, case.v_cache):  # the shared blocks hold only NaN before the step
        cache[shared.long()] = float("nan")
    out, _, _ = run_backend(case)
    assert_close(out, case)


def test_padded_tokens_are_skipped():
    case = Case([(10, 3), (17, 1)], 16, 4, 2, 32, torch.float32, seed=5)
    meta = case.meta()
    pad = 2
    backend = TritonAttentionBackend(4, 32, 2, case.scale)
    k_cache, v_cache = case.caches()
    query = torch.cat([case.query, torch.randn(pad, 4, 32)]).to(DEVICE)
    key = torch.cat([case.key, torch.randn(pad, 2, 32)]).to(DEVICE)
    value = torch.cat([case.value, torch.randn(pad, 2, 32)]).to(DEVICE)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    out = backend.forward(query, key, value, k_cache, v_cache, meta).cpu()
    assert_close(out[:-pad], case)
    assert torch.equal(out[-pad:], torch.zeros(pad, 4, 32))
    expected = case.k_cache.clone()
    expected.view(-1, 2, 32)[case.slot_mapping] = case.key
    torch.testing.assert_close(k_cache.cpu(), expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_exactly_its_slots(dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads, dim = 5, 16, 3, 80
    k_cache = torch.full((num_blocks, block_size, heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:12]
    slots[4] = -1  # a padded token
    # key/value as strided views of a fused projection output, like a real QKV split.
    qkv = torch.randn(12, 2 * heads + 1, dim, generator=g).to(dtype)
    key, value = qkv[:, :heads], qkv[:, heads : 2 * heads]
    k_dev, v_dev = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    tk.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
    expected_k, expected_v = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
    keep = slots >= 0
    expected_k[slots[keep]] = key[keep]
    expected_v[slots[keep]] = value[keep]
    torch.testing.assert_close(k_dev.cpu(), k_cache, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_dev.cpu(), v_cache, rtol=0, atol=0, equal_nan=True)


def test_choose_num_segments():
    # Plenty of programs, or a mixed batch: no split.
    assert choose_num_segments(256, 8, 4096, 132, decode_only=True) == 1
    assert choose_num_segments(1, 8, 4096, 132, decode_only=False) == 1
    # One long sequence on a big GPU: split up to the cap; short contexts split less.
    assert choose_num_segments(1, 8, 8192, 132, decode_only=True) == 16
    assert choose_num_segments(1, 8, 256, 132, decode_only=True) == 4
    assert choose_num_segments(1, 8, 100, 132, decode_only=True) == 1


def test_import_pagellm_does_not_import_triton():
    code = (
        "import sys, pagellm, pagellm.attention.backend, pagellm.forward_context; "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
