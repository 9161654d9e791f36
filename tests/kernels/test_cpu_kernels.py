"""The C++ CPU kernels against independent references.

Decode attention vs a dense float64 attention over random, scattered block tables (every slot
no sequence owns holds NaN, so a read outside a sequence poisons the result), over head shapes
that take each code path (register-blocked G x D, the generic accumulator, non-multiple-of-16
head dims); element-wise kernels vs the plain PyTorch ops they replace, bit for bit in bfloat16;
the row argmax vs torch.argmax (ties, NaN, -inf, strided rows); prefill attention (AMX or AVX-512)
vs a dense float64 causal attention; the AMX linear and the packed AVX-512 linear vs a float64
matmul, and the layers' choice of matmul after loading.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_ops
from pagellm.kernels.cpu_matmul import onednn_supports

# Every test runs once per kernel build this machine can run (tests/conftest.py: cpu_isa).
pytestmark = [pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler"),
              pytest.mark.usefixtures("cpu_isa")]

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _decode_case(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    keys, values, tables = [], [], []
    for n in lens:
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        table = [ids.pop() for _ in range(-(-n // block_size))]
        for pos in range(n):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        keys.append(k)
        values.append(v)
        tables.append(table)
    width = max(len(t) for t in tables) + 1
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    return query, keys, values, k_cache, v_cache, block_tables


def _dense_decode(query, keys, values, scale):
    num_heads = query.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        group = num_heads // k.shape[1]
        for h in range(num_heads):
            s = (k[:, h // group].double() @ query[i, h].double()) * scale
            out[i, h] = torch.softmax(s, 0) @ v[:, h // group].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # the default model: G=3, D=64 register-blocked
    (8, 1, 128, 32),   # G=8, D=128, blocks of 32 (two 16-token chunks per block)
    (4, 4, 64, 16),    # no GQA
    (16, 1, 64, 16),   # G=16: generic accumulator
    (32, 8, 64, 16),   # 32 heads: more than one score tile holds, vector path
    (6, 2, 80, 16),    # D=80: multiple of 16 but not register-blocked
    (4, 2, 40, 8),     # D=40: scalar paths, small blocks
    (4, 2, 64, 8),     # AMX-shaped heads, blocks under one 16-token tile: the vector path
    (9, 3, 64, 1),     # one token per block
    (8, 2, 128, 64),   # four 16-token tiles per block
])
def test_decode_attention_matches_dense(dtype, num_heads, num_kv_heads, head_dim, block_size):
    lens = [1, 15, 16, 17, 33, 300, 7]
    query, keys, values, k_cache, v_cache, tables = _decode_case(
        lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(query, float("nan"))
    seq_ids = torch.arange(len(lens))
    cpu_ops.paged_attention(out, query, k_cache, v_cache, tables,
                            torch.tensor(lens, dtype=torch.int32), seq_ids, seq_ids, scale)
    torch.testing.assert_close(out.double(), _dense_decode(query, keys, values, scale),
                               **TOL[dtype])


def test_decode_attention_subset_rows_and_strides():
    """Only the listed sequences are computed, each into its own token row; query and output
    rows may be strided (the query is a view of a wider projection)."""
    lens = [40, 5, 77]
    query, keys, values, k_cache, v_cache, tables = _decode_case(lens, 4, 2, 64, 16,
                                                                 torch.float32, seed=2)
    wide = torch.zeros(6, 4 * 64 + 32)
    q_view = wide[:, :256].view(6, 4, 64)
    rows = torch.tensor([4, 1], dtype=torch.int64)
    seq_ids = torch.tensor([2, 0], dtype=torch.int64)
    q_view[4], q_view[1] = query[2], query[0]
    out = torch.zeros(6, 4, 64)
    cpu_ops.paged_attention(out, q_view, k_cache, v_cache, tables,
                            torch.tensor([lens[2], lens[0]], dtype=torch.int32), seq_ids, rows,
                            0.125)
    ref = _dense_decode(query, keys, values, 0.125)
    torch.testing.assert_close(out[4].double(), ref[2], **TOL[torch.float32])
    torch.testing.assert_close(out[1].double(), ref[0], **TOL[torch.float32])
    assert out[[0, 2, 3, 5]].abs().sum() == 0  # untouched rows


def _prefill_kernel_takes(dtype: torch.dtype, head_dim: int) -> bool:
    return cpu_ops.prefill_attention_supports(torch.empty(1, 1, head_dim, dtype=dtype),
                                              torch.empty(1, 16, 1, head_dim, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),    # the default model
    (4, 4, 32, 16),    # no GQA, one 32-dim half
    (8, 1, 128, 32),   # G=8, two 16-token halves per block
    (4, 2, 96, 16),    # D=96: P.V over 6 dim blocks (a group of 4, then 2)
    (6, 2, 80, 16),    # D=80 (float32 only): P.V over 4 + 1 dim blocks
])
def test_prefill_attention_matches_dense(dtype, num_heads, num_kv_heads, head_dim, block_size):
    """Chunks with and without cached context, lengths off every tile and step edge, attended
    causally over scattered blocks (NaN in every slot no sequence owns), against float64; on
    AMX (bfloat16) or the AVX-512 kernels, whichever this machine has."""
    if not _prefill_kernel_takes(dtype, head_dim):
        pytest.skip(f"no prefill kernel for {dtype} and head_dim {head_dim} on this CPU")
    # (tokens cached in all, of which this chunk's new rows)
    cases = [(37, 37), (300, 45), (16, 16), (70, 1), (129, 129), (5, 3), (33, 32)]
    ctx = [c for c, _ in cases]
    query_all, keys, values, k_cache, v_cache, tables = _decode_case(
        ctx, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=5)
    g = torch.Generator().manual_seed(9)
    total = sum(n for _, n in cases)
    # Rows strided in a wider projection, the sequences' rows in a shuffled order.
    wide = torch.randn(total, num_heads * head_dim + 64, generator=g).to(dtype)
    query = wide[:, : num_heads * head_dim].view(total, num_heads, head_dim)
    order = [4, 0, 6, 2, 5, 1, 3]
    starts, row = {}, 0
    for i in order:
        starts[i] = row
        row += cases[i][1]
    out = torch.full((total, num_heads, head_dim), float("nan"), dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    idx = list(range(len(cases)))
    cpu_ops.prefill_attention(
        out, query, k_cache, v_cache, tables,
        torch.tensor([starts[i] for i in idx], dtype=torch.int64),
        torch.tensor([n for _, n in cases], dtype=torch.int32),
        torch.tensor(ctx, dtype=torch.int32), torch.tensor(idx, dtype=torch.int64), scale)
    group = num_heads // num_kv_heads
    # bfloat16: P is rounded to bfloat16 for the P.V products, the output once more.
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for i, (c, n) in enumerate(cases):
        q = query[starts[i] : starts[i] + n].double()
        k, v = keys[i].double(), values[i].double()
        for h in range(num_heads):
            s = q[:, h] @ k[:, h // group].T * scale
            pos = torch.arange(c - n, c)[:, None]
            s = s.masked_fill(torch.arange(c)[None, :] > pos, float("-inf"))
            ref = torch.softmax(s, -1) @ v[:, h // group]
            torch.testing.assert_close(out[starts[i] : starts[i] + n, h].double(), ref,
                                       **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_strided_rows(dtype):
    qkv = torch.randn(5, 3 * 2 * 16).to(dtype)
    key = qkv[:, 32:64].view(5, 2, 16)
    value = qkv[:, 64:].view(5, 2, 16)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=dtype)
    v_cache = torch.zeros(4, 4, 2, 16, dtype=dtype)
    slots = torch.tensor([15, 0, 6, 7, 9])
    cpu_ops.write_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(16, 2, 16)[slots], key)
    assert torch.equal(v_cache.view(16, 2, 16)[slots], value)
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert k_cache.view(16, -1)[others].abs().sum() == 0


def _torch_rms_norm(x, w, eps, residual=None):
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(37, 576, generator=g)).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    res = torch.randn(37, 576, generator=g).to(dtype) if with_residual else None
    out, summed = cpu_ops.rms_norm(x, w, 1e-5, res)
    ref, ref_sum = _torch_rms_norm(x, w, 1e-5, res)
    if with_residual:
        assert torch.equal(summed, ref_sum)
    # Only the float32 sum of squares may differ in order: at most one rounding step apart.
    torch.testing.assert_close(out, ref, **(dict(atol=0, rtol=1e-5) if dtype == torch.float32
                                            else dict(atol=0, rtol=8e-3)))
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    x = (4 * torch.randn(9, 2 * 1536)).to(dtype)
    ref = F.silu(x[:, :1536]) * x[:, 1536:]
    out = cpu_ops.silu_and_mul(x)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 8e-3)
    if dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 7, 16, 33, 49152])
def test_argmax_rows_matches_torch(dtype, cols):
    g = torch.Generator().manual_seed(cols)
    cases = {
        "random": torch.randn(6, cols, generator=g),
        # Few distinct values: ties everywhere, the first maximum must win.
        "ties": torch.randint(0, 3, (6, cols), generator=g).float(),
        "all -inf": torch.full((6, cols), float("-inf")),
    }
    with_nan = torch.randn(6, cols, generator=g)
    with_nan[0, -1] = with_nan[3, cols // 2] = with_nan[3, cols - 1] = float("nan")
    cases["nan"] = with_nan
    for name, x in cases.items():
        x = x.to(dtype)
        assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1)), name
    # Strided rows: the logits of a padded vocabulary are a view.
    wide = torch.randn(5, cols + 40, generator=g).to(dtype)
    view = wide[:, :cols]
    assert torch.equal(cpu_ops.argmax_rows(view), view.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_torch(dtype):
    from pagellm.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 64, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = torch.randn(11, (9 + 2 * 3) * 64).to(dtype)
    q, k = qkv[:, :576], qkv[:, 576:768]
    positions = torch.tensor([0, 1, 2, 3, 100, 101, 4000, 7, 8, 9, 4095])
    cos = rope.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    sin = rope.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    ref_q, ref_k = rope._rotate(q.clone(), cos, sin), rope._rotate(k.clone(), cos, sin)
    v_before = qkv[:, 768:].clone()
    cpu_ops.rotary_(q, k, positions, rope.cos_cache, rope.sin_cache, 64)
    torch.testing.assert_close(q, ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, ref_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 768:], v_before)  # V untouched


def test_rotary_out_of_range_position_poisons_instead_of_reading_outside():
    cos = torch.ones(8, 4)
    q, k = torch.ones(2, 8), torch.ones(2, 8)
    cpu_ops.rotary_(q, k, torch.tensor([3, 8]), cos, cos.clone(), 8)
    assert torch.isfinite(q[0]).all() and torch.isnan(q[1]).all()


def _require_amx_linear() -> None:
    # Asked inside each test: the build in use (cpu_isa) decides, not the native one.
    if not cpu_ops.linear_supports(torch.empty(16, 32, dtype=torch.bfloat16)):
        pytest.skip("no AMX tiles in this build (or not granted)")


def _close_to_float64(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      bias: torch.Tensor | None) -> None:
    """``out`` is ``x @ w.T + bias`` from bfloat16 inputs, summed in float32, rounded once."""
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # float32 sums of K products (~K * 2^-24 relative each) plus one bfloat16 rounding (2^-9).
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + scale * 1e-5).all(), err.max().item()


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 31, 33, 64, 300])
@pytest.mark.parametrize("n,k,bias", [(16, 32, False), (48, 64, True), (960, 576, False),
                                      (80, 1536, True)])
def test_amx_linear_matches_float64(rows, n, k, bias):
    _require_amx_linear()
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    # Rows strided inside a wider tensor, and NaN beside them: a read past a row poisons.
    wide = torch.full((rows, k + 32), float("nan"), dtype=torch.bfloat16)
    wide[:, :k] = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    x = wide[:, :k]
    out = cpu_ops.linear(x, w, b)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _close_to_float64(out, x, w, b)
    # As close to the float64 result as torch's own bfloat16 matmul, give or take a rounding.
    ours = (out.double() - (x.double() @ w.double().T + (0 if b is None else b.double())))
    torchs = (F.linear(x, w, b).double() - (x.double() @ w.double().T
                                            + (0 if b is None else b.double())))
    assert ours.abs().mean() <= 1.5 * torchs.abs().mean() + 1e-6


def test_amx_linear_keeps_leading_dims_and_empty_input():
    _require_amx_linear()
    w = torch.randn(32, 64).to(torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    out = cpu_ops.linear(x, w, None)
    assert out.shape == (2, 3, 32)
    _close_to_float64(out.reshape(6, 32), x.reshape(6, 64), w, None)
    assert cpu_ops.linear(x[:0], w, None).shape == (0, 3, 32)


def _packed_kernel_takes(dtype: torch.dtype) -> bool:
    return cpu_ops.linear_packed_supports(torch.empty(16, 32, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 16, 17, 33, 300])
@pytest.mark.parametrize("n,k,bias", [(16, 32, False), (48, 64, True), (32, 64, False),
                                      (80, 40, True), (48, 54, True), (960, 576, False),
                                      (576, 1536, True)])
def test_packed_linear_matches_float64(dtype, rows, n, k, bias):
    """The AVX-512 kernel on packed weights: every micro-kernel shape (8-row groups and each
    leftover count, panels of 3, 2 and 1 output blocks; the one- and two-row streaming path,
    an odd number of bfloat16 pair steps for its two accumulators), K off the vector width."""
    if not _packed_kernel_takes(dtype):
        pytest.skip(f"no packed linear kernel for {dtype} on this CPU")
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    # Rows strided inside a wider tensor, and NaN beside them: a read past a row poisons.
    wide = torch.full((rows, k + 32), float("nan"), dtype=dtype)
    wide[:, :k] = torch.randn(rows, k, generator=g).to(dtype)
    x = wide[:, :k]
    packed = cpu_ops.linear_pack(w)
    assert packed.shape == (n // 16, 16 * k) and packed.dtype == dtype
    out = cpu_ops.linear_packed(x, packed, b)
    assert out.shape == (rows, n) and out.dtype == dtype
    if dtype == torch.bfloat16:
        _close_to_float64(out, x, w, b)
    else:
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        scale = (x.double().abs() @ w.double().abs().T).max().item()
        assert ((out.double() - ref).abs() <= scale * 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_keeps_leading_dims_and_empty_input(dtype):
    if not _packed_kernel_takes(dtype):
        pytest.skip(f"no packed linear kernel for {dtype} on this CPU")
    w = torch.randn(32, 64).to(dtype)
    x = torch.randn(2, 3, 64).to(dtype)
    out = cpu_ops.linear_packed(x, cpu_ops.linear_pack(w), None)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out, F.linear(x.float(), w.float()).to(dtype), **TOL[dtype])
    assert cpu_ops.linear_packed(x[:0], cpu_ops.linear_pack(w), None).shape == (0, 3, 32)
    assert not cpu_ops.linear_packed_supports(torch.randn(40, 64).to(dtype))


def test_cpu_matmul_choice_after_loading():
    """Each layer's matmul after loading: bf16 layers AMX can serve keep their plain weight and
    use the kernel up to AMX_LINEAR_MAX_ROWS rows (torch's matmul, bit for bit, beyond); else
    the weight is packed for the AVX-512 kernel where it takes it (whole 16-output blocks), for
    every row count; else oneDNN's prepacked weight (bit-identical to F.linear in bfloat16,
    another summation order than MKL's in float32). Every result is checked against the float64
    product, or bit for bit where it must be."""
    from pagellm.layers.embedding import ParallelLMHead
    from pagellm.layers.linear import (
        AMX_LINEAR_MAX_ROWS,
        MergedColumnParallelLinear,
        prepack_linears_for_cpu,
    )

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "mlp": MergedColumnParallelLinear(64, [96, 96], bias=True, params_dtype=torch.bfloat16),
        "odd": MergedColumnParallelLinear(64, [20, 20], bias=False, params_dtype=torch.bfloat16),
        "head": ParallelLMHead(300, 64, params_dtype=torch.bfloat16),
        "fp32": MergedColumnParallelLinear(64, [32, 32], bias=True),
    })
    for p in model.parameters():
        torch.nn.init.normal_(p)
    few = torch.randn(7, 64).to(torch.bfloat16)
    many = torch.randn(AMX_LINEAR_MAX_ROWS + 1, 64).to(torch.bfloat16)

    def run(name, m, x):
        x = x.float() if name == "fp32" else x
        return m.compute_logits(x) if name == "head" else m(x)

    before = {name: [run(name, m, x) for x in (few, many)] for name, m in model.items()}
    plain = {name: (m.weight.detach().clone(), getattr(m, "bias", None))
             for name, m in model.items()}
    amx = cpu_ops.linear_supports(plain["mlp"][0])
    vec = {name: cpu_ops.linear_packed_supports(w) for name, (w, _) in plain.items()}
    assert not vec["odd"] and not vec["head"]  # 40 and 300 outputs: not whole 16-row blocks
    # oneDNN's bf16 layout needs AVX-512 or AVX-NE-CONVERT: elsewhere bf16 stays with F.linear.
    bf16_onednn = onednn_supports(torch.bfloat16)
    # fp32 always gets one; mlp the AMX, AVX-512 or oneDNN one; odd and head AMX or oneDNN.
    num_kernels = 1 + (amx or vec["mlp"] or bf16_onednn) + 2 * (amx or bf16_onednn)
    assert prepack_linears_for_cpu(model) == num_kernels
    assert model["mlp"].weight.is_mkldnn == (not amx and not vec["mlp"] and bf16_onednn)
    assert model["mlp"].cpu_packed == (not amx and vec["mlp"])
    assert model["odd"].weight.is_mkldnn == (not amx and bf16_onednn)
    assert model["fp32"].cpu_packed == vec["fp32"]
    assert model["fp32"].weight.is_mkldnn != vec["fp32"]
    for name, m in model.items():
        w, bias = plain[name]
        for x, b in zip((few, many), before[name], strict=True):
            a = run(name, m, x)
            x = x.float() if name == "fp32" else x
            if name == "fp32":
                ref = x.double() @ w.double().T + bias.double()
                scale = (x.double().abs() @ w.double().abs().T).max().item()
                assert a.dtype == torch.float32
                assert ((a.double() - ref).abs() <= scale * 1e-6).all()
            elif name == "mlp" and ((amx and x is few) or m.cpu_packed):
                _close_to_float64(a, x, w, bias)
            else:
                assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_and_kv_writes_refuse_indices_outside_the_cache(dtype):
    """A block id, block-table row, length, token row or slot outside the cache or the batch is
    an IndexError, checked before the kernel reads or writes there (the assertions of a caller
    run under `python -O` are gone; the kernels check for themselves)."""
    lens = [20, 9]
    query, _, _, k_cache, v_cache, tables = _decode_case(lens, 4, 2, 64, 16, dtype, seed=3)
    num_blocks = k_cache.shape[0]
    out = torch.zeros_like(query)
    rows = torch.arange(2)
    lens_t = torch.tensor(lens, dtype=torch.int32)

    def decode(tables=tables, lens_t=lens_t, bt_rows=rows, token_rows=rows):
        cpu_ops.paged_attention(out, query, k_cache, v_cache, tables, lens_t, bt_rows,
                                token_rows, 0.125)

    decode()  # the case itself is valid
    for block_id in (num_blocks, -1, 2**31 - 1):
        bad = tables.clone()
        bad[0, 1] = block_id
        with pytest.raises(IndexError, match="outside the cache"):
            decode(tables=bad)
    with pytest.raises(IndexError):
        decode(bt_rows=torch.tensor([0, tables.shape[0]]))
    with pytest.raises(IndexError):
        decode(token_rows=torch.tensor([0, 2]))
    with pytest.raises(IndexError):  # longer than its block-table row can hold
        decode(lens_t=torch.tensor([tables.shape[1] * 16 + 1, 9], dtype=torch.int32))
    with pytest.raises(IndexError):
        decode(lens_t=torch.tensor([0, 9], dtype=torch.int32))

    key = torch.randn(3, 2, 64).to(dtype)
    before = k_cache.clone()
    with pytest.raises(IndexError, match="slot"):
        cpu_ops.write_kv(key, key.clone(), k_cache, v_cache,
                         torch.tensor([0, num_blocks * 16, 5]))
    # The valid slots may be written; nothing else changed.
    changed = (k_cache != before) & ~(k_cache.isnan() & before.isnan())
    assert not changed.view(-1, 2 * 64)[[i for i in range(num_blocks * 16) if i not in (0, 5)]
                                        ].any()

    if _prefill_kernel_takes(dtype, 64):
        def prefill(q_lens, ctx, bt=tables):
            cpu_ops.prefill_attention(
                out, query, k_cache, v_cache, bt, torch.tensor([0], dtype=torch.int64),
                torch.tensor(q_lens, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
                torch.tensor([1], dtype=torch.int64), 0.125)

        prefill([2], [9])
        with pytest.raises(IndexError):
            prefill([3], [2])  # more new rows than cached tokens
        with pytest.raises(IndexError):
            prefill([2], [tables.shape[1] * 16 + 1])
        bad = tables.clone()
        bad[1, 0] = num_blocks
        with pytest.raises(IndexError):
            prefill([2], [9], bt=bad)
