"""Prefill attention over block tables that share blocks (prefix-cache hits).

The prefill kernels pack each full run of keys once per step and let every sequence whose table
holds the same blocks read that copy (cpu_prefill.h). These check that sharing never changes a
result: a batch of chunks over one shared prefix (the prefix-caching workload's shape: one
chunk computing the prefix, others attending to it with short suffixes) against a dense float64
causal attention and bit for bit against each chunk attended alone (no sharing possible), and
tables that share a block but not the blocks around it (no copy may be shared then).
"""

from __future__ import annotations

import math

import pytest
import torch

from pagellm.kernels import cpu_ops

pytestmark = [pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler"),
              pytest.mark.usefixtures("cpu_isa")]


def _kernel_takes(dtype: torch.dtype, head_dim: int) -> bool:
    return cpu_ops.prefill_attention_supports(torch.empty(1, 1, head_dim, dtype=dtype),
                                              torch.empty(1, 16, 1, head_dim, dtype=dtype))


def _attend(query, k_cache, v_cache, tables, rows, q_lens, ctx, seqs):
    """prefill_attention of the chunks ``seqs`` only, into a NaN-filled output."""
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    cpu_ops.prefill_attention(
        out, query, k_cache, v_cache, tables,
        torch.tensor([rows[i] for i in seqs], dtype=torch.int64),
        torch.tensor([q_lens[i] for i in seqs], dtype=torch.int32),
        torch.tensor([ctx[i] for i in seqs], dtype=torch.int32),
        torch.tensor(seqs, dtype=torch.int64), 1 / math.sqrt(query.shape[2]))
    return out


def _check(tables_py, ctx, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """Fill the blocks the tables name (NaN elsewhere), attend every chunk in one call, and
    compare with the dense reference and with each chunk alone."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = max(max(t) for t in tables_py) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for table, c in zip(tables_py, ctx, strict=True):
        for b in table[: -(-c // block_size)]:
            if k_cache[b].isnan().any():  # a shared block is written once
                k_cache[b] = torch.randn(shape[1:], generator=g).to(dtype)
                v_cache[b] = torch.randn(shape[1:], generator=g).to(dtype)
    width = max(len(t) for t in tables_py)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables_py], dtype=torch.int32)
    rows = [0]
    for n in q_lens[:-1]:
        rows.append(rows[-1] + n)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    seqs = list(range(len(ctx)))
    out = _attend(query, k_cache, v_cache, tables, rows, q_lens, ctx, seqs)
    group = num_heads // num_kv_heads
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for i in seqs:
        alone = _attend(query, k_cache, v_cache, tables, rows, q_lens, ctx, [i])
        chunk = slice(rows[i], rows[i] + q_lens[i])
        assert torch.equal(out[chunk], alone[chunk]), f"chunk {i} differs when batched"
        pos = torch.arange(ctx[i])
        blocks = tables[i, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].double()
        v = v_cache[blocks, pos % block_size].double()
        q = query[chunk].double()
        for h in range(num_heads):
            s = q[:, h] @ k[:, h // group].T / math.sqrt(head_dim)
            qpos = torch.arange(ctx[i] - q_lens[i], ctx[i])[:, None]
            s = s.masked_fill(pos[None, :] > qpos, float("-inf"))
            ref = torch.softmax(s, -1) @ v[:, h // group]
            torch.testing.assert_close(out[chunk, h].double(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # the default model
    (8, 1, 128, 32),   # blocks of 32
    (4, 2, 64, 8),     # blocks of 8: a packed unit spans 4 or 8 of them
    (4, 2, 64, 48),    # blocks of 48: units start inside blocks, at several offsets
])
def test_chunks_over_a_shared_prefix(dtype, num_heads, num_kv_heads, head_dim, block_size):
    if not _kernel_takes(dtype, head_dim):
        pytest.skip(f"no prefill kernel for {dtype} and head_dim {head_dim} on this CPU")
    prefix = 200  # not a multiple of any unit or block: the shared run ends mid-unit
    shared = list(range(prefix // block_size))  # the prefix's full blocks
    nxt = len(shared)
    tables, ctx, q_lens = [], [], []
    # The chunk computing the prefix and its suffix, then chunks hitting the prefix's full
    # blocks with suffixes of several lengths (one whole chunk of 1 row).
    for suffix, q_len in [(40, None), (33, 33 + prefix % block_size), (1, 1), (70, 70),
                          (64, 64 + prefix % block_size)]:
        c = prefix + suffix
        own = -(-c // block_size) - len(shared)
        tables.append(shared + list(range(nxt, nxt + own)))
        nxt += own
        ctx.append(c)
        q_lens.append(c if q_len is None else q_len)
    _check(tables, ctx, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_sharing_some_blocks_only(dtype):
    """Sequences whose tables share a unit's last block but not its others, or its first ones
    but not its last, or the same blocks in another order: each still reads its own keys."""
    if not _kernel_takes(dtype, 64):
        pytest.skip(f"no prefill kernel for {dtype} on this CPU")
    tables = [
        list(range(0, 12)),
        [20, 21, 22, 3, 4, 5, 6, 7, 8, 9, 10, 11],   # blocks 3.. shared, 0-2 not
        [0, 1, 2, 3, 30, 31, 32, 33, 34, 35, 36, 37],  # blocks 0-3 shared, the rest not
        [1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10],        # the same blocks, pairs swapped
        list(range(0, 12)),                            # all shared with the first
    ]
    ctx = [190, 185, 192, 191, 130]
    q_lens = [190, 40, 17, 64, 2]
    _check(tables, ctx, q_lens, 9, 3, 64, 16, dtype, seed=4)
