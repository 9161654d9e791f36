"""The C++ decode attention with a sliding window and a logit soft-cap, per kernel build
(tests/conftest.py: cpu_isa), vs a dense float64 reference: blocks wholly before each window
are poisoned (NaN, as a block freed and reused would be garbage), so a kernel that reads below
the window fails; head shapes cover the register-blocked, generic and bfloat16 pair paths."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm.kernels import cpu_ops

pytestmark = [pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler"),
              pytest.mark.usefixtures("cpu_isa")]

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
LENS = [1, 15, 16, 17, 33, 300, 7, 64, 65]


def _case(num_heads, num_kv_heads, head_dim, block_size, dtype, window, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in LENS) + 2
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)  # block 0: every freed entry
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values, tables = [], [], []
    for n in LENS:
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        first = max(n - window, 0) // block_size if window else 0  # block of the first key
        table = [0 if b < first else ids.pop() for b in range(-(-n // block_size))]
        for pos in range(first * block_size, n):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
        tables.append(table)
    width = max(len(t) for t in tables) + 1
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(len(LENS), num_heads, head_dim, generator=g).to(dtype)
    return query, keys, values, k_cache, v_cache, block_tables


def _dense(query, keys, values, scale, window, cap):
    num_heads = query.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        group = num_heads // k.shape[1]
        n = k.shape[0]
        start = max(n - window, 0) if window else 0
        for h in range(num_heads):
            s = (k[start:, h // group].double() @ query[i, h].double()) * scale
            if cap:
                s = torch.tanh(s / cap) * cap
            out[i, h] = torch.softmax(s, 0) @ v[start:, h // group].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # register-blocked G x D
    (16, 1, 64, 16),   # generic accumulator
    (4, 2, 40, 8),     # scalar paths, small blocks
    (8, 2, 128, 32),   # AMX-shaped heads (the window keeps them on the vector path)
])
@pytest.mark.parametrize("window,cap", [(16, None), (5, 3.0), (None, 2.0)])
def test_windowed_decode_matches_dense(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                       window, cap):
    query, keys, values, k_cache, v_cache, tables = _case(
        num_heads, num_kv_heads, head_dim, block_size, dtype, window)
    scale = 0.8 / head_dim**0.5
    out = torch.full_like(query, float("nan"))
    rows = torch.arange(len(LENS))
    cpu_ops.paged_attention(out, query, k_cache, v_cache, tables,
                            torch.tensor(LENS, dtype=torch.int32), rows, rows, scale,
                            sliding_window=window, soft_cap=cap)
    torch.testing.assert_close(out.double(), _dense(query, keys, values, scale, window, cap),
                               **TOL[dtype])
