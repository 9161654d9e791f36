"""Tensor-level wrappers of the CPU kernels (see ``cpu_ops.cpp``).

Each wrapper checks what the kernel assumes (CPU, float32/bfloat16, unit stride in the last
dimension) through ``supports``; callers test that first and fall back to PyTorch otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from ctypes import c_float, c_int, c_int64, c_void_p

import torch

from pagellm.kernels import cpu_build
from pagellm.kernels.cpu_signatures import RETURNS_INT, SIGNATURES
from pagellm.kernels.huge_pages import empty_on_huge_pages

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class CacheBounds(ctypes.Structure):
    """What an attention call may index (``CacheBounds`` in ``cpu_common.h``): block ids below
    ``num_blocks``, block-table rows below ``bt_rows`` of ``bt_width`` entries, query/output rows
    below ``rows``. The kernels check every sequence against it before reading the cache."""

    _fields_ = [(name, c_int64) for name in ("num_blocks", "bt_rows", "bt_width", "rows")]


def _bounds(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            rows: int) -> CacheBounds:
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"cpu_ops: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} differ")
    return CacheBounds(k_cache.shape[0], block_tables.shape[0], block_tables.shape[1], rows)


def _out_of_bounds(what: str, bounds: CacheBounds) -> IndexError:
    return IndexError(
        f"cpu_ops.{what}: a block id, block-table row, length or token row lies outside the "
        f"cache ({bounds.num_blocks} blocks) or the batch (block tables {bounds.bt_rows} x "
        f"{bounds.bt_width}, {bounds.rows} rows); nothing outside them was read or written")


def _check(ok: bool, what: str, why: str) -> None:
    # Layout checks that `python -O` must not remove (the kernels index by them).
    if not ok:
        raise ValueError(f"cpu_ops.{what}: {why}")


class LlamaLayer(ctypes.Structure):
    """One decoder layer's tensors for ``llama_forward`` (``PagellmLlamaLayer``)."""

    _fields_ = [(name, c_void_p) for name in (
        "input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias",
        "down", "down_bias", "k_cache", "v_cache")]


class LlamaShape(ctypes.Structure):
    """A model's shape for ``llama_forward`` (``PagellmLlamaShape``): ``dtype`` a dtype code,
    ``packed`` 1 for weights packed by ``linear_pack``, 0 for plain ones on the AMX kernel."""

    _fields_ = [*((name, c_int64) for name in (
        "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "rot_dim", "max_pos",
        "block_size")), ("eps", c_float), ("scale", c_float), ("dtype", c_int64),
        ("packed", c_int64)]


class ForwardStep(ctypes.Structure):
    """One step for ``llama_forward`` (``PagellmForwardStep``)."""

    _fields_ = [("num_tokens", c_int64),
                *((name, c_void_p) for name in (
                    "hidden", "residual", "normed", "qkv", "attn", "gate_up", "act", "positions",
                    "slots", "cos_cache", "sin_cache", "block_tables")),
                ("bt_stride", c_int64),
                *((name, c_void_p) for name in ("lens", "bt_rows", "token_rows")),
                ("num_items", c_int64), ("final_norm", c_void_p), ("num_prefill", c_int64),
                *((name, c_void_p) for name in ("prefill_rows", "prefill_lens", "prefill_ctx",
                                                "prefill_bt_rows")),
                *((name, c_int64) for name in ("num_blocks", "bt_height", "bt_width"))]



# The kernels' answer for an index outside the cache or the batch (kOutOfBounds).
_OUT_OF_BOUNDS = -1

# The kernel paths, newest first (pagellm_kernel_paths' bits 1, 2, 4; generic always built).
KERNEL_PATHS = ("amx", "avx512-bf16", "avx512", "generic")

_lib: ctypes.CDLL | None = None
_checked = False


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = c_int if name in RETURNS_INT else None
    return lib


def _library() -> ctypes.CDLL | None:
    global _lib, _checked
    if not _checked:
        lib = cpu_build.load()
        _lib, _checked = (None if lib is None else _typed(lib)), True
    return _lib


def kernel_paths() -> list[str]:
    """The kernel paths of the build in use, newest first (``KERNEL_PATHS``); [] without the
    kernels. A kernel takes the newest one that serves the shape at hand."""
    if _library() is None:
        return []
    bits = _lib.pagellm_kernel_paths()
    return [name for bit, name in zip((1, 2, 4, 0), KERNEL_PATHS, strict=True)
            if bit == 0 or bits & bit]


@contextlib.contextmanager
def built_for(isa: str) -> Iterator[list[str]]:
    """For tests: inside the block the wrappers call the build for ``isa`` (``cpu_build.ISA_FLAGS``,
    e.g. ``"generic"`` runs the plain loops on an AVX-512 machine); yields its kernel paths.
    Layers that picked a kernel at load keep their choice: build them inside the block."""
    global _lib, _checked
    saved = _library()
    lib = cpu_build.load(isa)
    if lib is None:
        raise RuntimeError(f"the CPU kernels cannot be built for {isa!r} here")
    _lib = _typed(lib)
    try:
        yield kernel_paths()
    finally:
        _lib, _checked = saved, True
def available() -> bool:
    return _library() is not None


def library() -> ctypes.CDLL | None:
    """The typed kernel library in use (the ``built_for`` one inside that block), or None:
    for wrappers kept in their own modules (cpu_moe.py, cpu_kv_quant.py)."""
    return _library()


def dtype_supported(dtype: torch.dtype) -> bool:
    """Whether the kernels take tensors of this dtype (float32 and bfloat16)."""
    return dtype in _DTYPE_CODES


def dtype_code(dtype: torch.dtype) -> int:
    """The kernels' code for a dtype they take (0 float32, 1 bfloat16)."""
    return _DTYPE_CODES[dtype]


def supports(*tensors: torch.Tensor) -> bool:
    """True when the kernels can run on these tensors (same dtype, CPU, last dim contiguous)."""
    # Called for every op of every layer: plain attribute checks, no device objects.
    if not _checked:
        _library()
    dtype = tensors[0].dtype
    if _lib is None or dtype not in _DTYPE_CODES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or t.stride(-1) != 1:
            return False
    return True


def linear_supports(weight: torch.Tensor) -> bool:
    """Whether ``linear`` can serve this weight: a contiguous CPU bfloat16 ``[N, K]`` with N a
    multiple of 16 and K of 32, on a CPU whose AMX tiles the process may use."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_cpu
            and not weight.is_mkldnn and weight.is_contiguous()
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
            and _library() is not None and bool(_lib.pagellm_linear_available()))


def _linear_call(call, x: torch.Tensor, n: int, k: int, dtype: torch.dtype,
                 bias: torch.Tensor | None, what: str) -> torch.Tensor:
    """``x [..., k]`` -> a new ``[..., n]`` of ``dtype`` from ``call(out, ldy, x, lda, bias,
    rows)``, a kernel answering 0 where it cannot run (``what``: its wrapper's name, whose
    ``*_supports`` check the caller skipped then)."""
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=dtype)
    if bias is not None:
        bias = bias.contiguous()  # held until the call returns
    if rows and not call(out.data_ptr(), n, x2.data_ptr(), x2.stride(0), ptr(bias), rows):
        raise RuntimeError(f"cpu_ops.{what} cannot take this weight here (check "
                           f"{what}_supports first)")
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in bfloat16 with AMX, the weight read in place (see
    ``cpu_linear.cpp``); ``weight`` must pass ``linear_supports``, ``x [..., K]`` be bfloat16
    with unit stride in its last dimension."""
    n, k = weight.shape
    return _linear_call(
        lambda y, ldy, xp, lda, b, rows: _library().pagellm_linear(
            y, ldy, xp, lda, weight.data_ptr(), b, rows, n, k),
        x, n, k, torch.bfloat16, bias, "linear")


def linear_packed_supports(weight: torch.Tensor) -> bool:
    """Whether ``linear_pack`` / ``linear_packed`` take this weight: a contiguous CPU float32
    or bfloat16 ``[N, K]``, N a multiple of 16 (K even in bfloat16), on a CPU with AVX-512
    (and AVX512-BF16 for bfloat16)."""
    return (weight.dim() == 2 and weight.dtype in _DTYPE_CODES and weight.is_cpu
            and not weight.is_mkldnn and weight.is_contiguous() and _library() is not None
            and bool(_lib.pagellm_linear_packed_available(_DTYPE_CODES[weight.dtype],
                                                          *weight.shape)))


def linear_pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in ``linear_packed``'s layout (``cpu_linear_vec.cpp``): blocks of 16 output
    rows, each ``[K/2][16][2]`` (bfloat16) or ``[K][16]`` (float32), as a ``[N // 16, 16 * K]``
    tensor of the same dtype, on 2 MiB pages where the system grants them (huge_pages.py: a
    batch-1 step streams it). Check ``linear_packed_supports`` first."""
    n, k = weight.shape
    out = empty_on_huge_pages((n // 16, 16 * k), weight.dtype)
    _library().pagellm_linear_pack(_DTYPE_CODES[weight.dtype], out.data_ptr(),
                                   weight.data_ptr(), n, k)
    return out


def linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with ``packed = linear_pack(weight)``, AVX-512 (see
    ``cpu_linear_vec.cpp``); ``x [..., K]`` and ``bias`` of its dtype, ``x`` unit stride in its
    last dimension."""
    n, k = packed.shape[0] * 16, packed.shape[1] // 16
    code = _DTYPE_CODES[packed.dtype]
    return _linear_call(
        lambda y, ldy, xp, lda, b, rows: _library().pagellm_linear_packed(
            code, y, ldy, xp, lda, packed.data_ptr(), b, rows, n, k),
        x, n, k, packed.dtype, bias, "linear_packed")


def llama_forward(layers: ctypes.Array, shape: LlamaShape, step: ForwardStep) -> None:
    """Every decoder layer and the final norm for one step (``cpu_decoder.cpp``);
    ``step.hidden`` holds the embeddings before and the final hidden states after."""
    rc = _library().pagellm_llama_forward(ctypes.byref(layers), len(layers),
                                          ctypes.byref(shape), ctypes.byref(step))
    if rc == _OUT_OF_BOUNDS:
        raise IndexError("cpu_ops.llama_forward: a slot, block id, block-table row or length "
                         f"lies outside the cache ({step.num_blocks} blocks) or the step "
                         f"(block tables {step.bt_height} x {step.bt_width}); nothing outside "
                         "them was read or written")
    if rc != 1:
        raise RuntimeError("cpu_ops.llama_forward cannot take this step here (check the "
                           "linears' kernel and, with prefill chunks, "
                           "prefill_head_dim_supported first)")


def prefill_head_dim_supported(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``prefill_attention`` takes this head size and dtype on this machine: bfloat16
    with AMX (granted) or AVX512-BF16, head_dim a multiple of 32 up to 256; float32 with
    AVX-512, a multiple of 16 up to 256."""
    return (_library() is not None and dtype in _DTYPE_CODES
            and bool(_lib.pagellm_prefill_attention_supported(_DTYPE_CODES[dtype], head_dim)))


def prefill_attention_supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``prefill_attention`` takes these: one dtype the kernels take for this head size
    (``prefill_head_dim_supported``), unit-stride heads, a contiguous cache."""
    return (query.dtype == k_cache.dtype and query.is_cpu
            and query.stride(-1) == 1 and query.stride(1) == query.shape[2]
            and k_cache.is_contiguous() and prefill_head_dim_supported(query.shape[2],
                                                                       query.dtype))


def prefill_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_tables: torch.Tensor, q_rows: torch.Tensor,
                      q_lens: torch.Tensor, ctx_lens: torch.Tensor, bt_rows: torch.Tensor,
                      scale: float) -> None:
    """Causal attention of prefill chunks over the cache (``cpu_prefill.cpp``): sequence i's
    rows ``[q_rows[i], q_rows[i] + q_lens[i])`` of ``query [T, H, D]`` are the last ``q_lens[i]``
    of its ``ctx_lens[i]`` cached tokens (K/V written), block-table row ``bt_rows[i]``; results
    go to the same rows of ``out``. Check ``prefill_attention_supports`` first."""
    what = "prefill_attention"
    _check(out.stride(1) == out.shape[2] and out.stride(2) == 1 and out.dtype == query.dtype,
           what, "out must be [T, H, D] with unit-stride heads, in the query's dtype")
    _check(block_tables.dtype == torch.int32 and block_tables.dim() == 2
           and block_tables.stride(1) == 1, what, "block_tables must be int32 [seqs, width]")
    _check(q_lens.dtype == ctx_lens.dtype == torch.int32
           and q_rows.dtype == bt_rows.dtype == torch.int64, what,
           "q_lens/ctx_lens must be int32, q_rows/bt_rows int64")
    _check(all(t.is_contiguous() and t.shape == q_rows.shape
               for t in (q_rows, q_lens, ctx_lens, bt_rows)), what,
           "q_rows, q_lens, ctx_lens and bt_rows must be contiguous, of one shape")
    bounds = _bounds(k_cache, v_cache, block_tables, min(query.shape[0], out.shape[0]))
    rc = _library().pagellm_prefill_attention(
        _DTYPE_CODES[query.dtype], out.data_ptr(), out.stride(0), query.data_ptr(),
        query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), q_rows.shape[0], q_rows.data_ptr(), q_lens.data_ptr(),
        ctx_lens.data_ptr(), bt_rows.data_ptr(), query.shape[1], k_cache.shape[-2],
        query.shape[2], k_cache.shape[1], scale, ctypes.byref(bounds))
    if rc == _OUT_OF_BOUNDS:
        raise _out_of_bounds(what, bounds)
    if rc != 1:
        if not paged_attention_supports(query.shape[1], k_cache.shape[-2], query.shape[2],
                                        k_cache.shape[1]):
            raise ValueError(_shape_refused(what, query.shape[1], k_cache.shape[-2],
                                            query.shape[2], k_cache.shape[1]))
        raise RuntimeError("cpu_ops.prefill_attention cannot take this dtype or head size "
                           "here (check prefill_attention_supports first)")


def ptr(t: torch.Tensor | None) -> int | None:
    """``t.data_ptr()``, or None (a null pointer) for None."""
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(x [+ residual]), x [+ residual] or None)`` for contiguous ``x [rows, hidden]``."""
    hidden = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = None
    if residual is not None:
        residual = residual.contiguous()
        res_out = torch.empty_like(x)
    _library().pagellm_rms_norm(_DTYPE_CODES[x.dtype], out.data_ptr(), ptr(res_out),
                                x.data_ptr(), ptr(residual), weight.contiguous().data_ptr(),
                                x.numel() // hidden, hidden, eps)
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype)
    _library().pagellm_silu_and_mul(_DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(),
                                    x.numel() // (2 * d), d)
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x [rows, cols]`` (rows may be strided): int64 ``[rows]``, the
    first index of each row's maximum, NaN counting as the maximum, as torch.argmax."""
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    _library().pagellm_argmax_rows(_DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(), rows,
                                   cols, x.stride(0))
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
            sin_cache: torch.Tensor, head_dim: int) -> None:
    """Rotate ``q [T, Hq*D]`` and ``k [T, Hk*D]`` in place (rows may be strided views) by
    ``positions``; ``cos_cache``/``sin_cache`` are contiguous float32 ``[max_pos, rot / 2]``. A
    position outside the table gives NaN rows, never a read outside it."""
    num_tokens = q.shape[0]
    positions = positions.to(torch.int64).contiguous()
    _library().pagellm_rotary(_DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0),
                              q.shape[1] // head_dim, k.data_ptr(), k.stride(0),
                              k.shape[1] // head_dim, positions.data_ptr(), num_tokens,
                              cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0],
                              head_dim, 2 * cos_cache.shape[1])


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store ``key/value [T, Hkv, D]`` (token rows may be strided) at flat ``slots [T]``."""
    slots = slots.to(torch.int64).contiguous()
    row = k_cache.shape[-2] * k_cache.shape[-1]
    _check(key.stride(1) == key.shape[2] and value.stride(1) == value.shape[2]
           and key.shape[1:] == value.shape[1:] == k_cache.shape[2:]
           and slots.shape[0] >= key.shape[0] and v_cache.shape == k_cache.shape, "write_kv",
           "key/value must be [T, Hkv, D] (unit-stride heads) of the cache's shape, one slot "
           "per token")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if _library().pagellm_write_kv(_DTYPE_CODES[key.dtype], k_cache.data_ptr(),
                                   v_cache.data_ptr(), key.data_ptr(), key.stride(0),
                                   value.data_ptr(), value.stride(0), slots.data_ptr(),
                                   key.shape[0], row, num_slots) != 1:
        raise IndexError(f"cpu_ops.write_kv: a slot lies outside the cache's {num_slots} slots; "
                         "no token was written outside it")


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor,
                    bt_rows: torch.Tensor, token_rows: torch.Tensor, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None) -> None:
    """Attention of single query rows over cached K/V: item i is query row ``token_rows[i]``
    attending to the first ``lens[i]`` tokens of the sequence whose block table is row
    ``bt_rows[i]`` of ``block_tables``, K/V read in place; written into ``out`` at that row.
    A decode token is one item; each token of a prefill chunk is one too, its length its own
    position + 1 (causal), once the chunk's K/V are written. ``sliding_window`` W: only the
    last W of those tokens, and no block before them is read; ``soft_cap`` c: scores become
    ``c * tanh(score / c)`` (either takes the vector path, never AMX)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    what = "paged_attention"
    _check(query.stride(1) == head_dim and out.stride(1) == head_dim, what,
           "query and out must have unit-stride heads")
    _check(block_tables.dtype == torch.int32 and block_tables.dim() == 2
           and block_tables.stride(1) == 1, what, "block_tables must be int32 [seqs, width]")
    _check(lens.dtype == torch.int32 and bt_rows.dtype == token_rows.dtype == torch.int64, what,
           "lens must be int32, bt_rows and token_rows int64")
    _check(lens.is_contiguous() and bt_rows.is_contiguous() and token_rows.is_contiguous()
           and lens.shape == bt_rows.shape == token_rows.shape, what,
           "lens, bt_rows and token_rows must be contiguous, of one shape")
    num_kv_heads, block_size = k_cache.shape[-2], k_cache.shape[1]
    bounds = _bounds(k_cache, v_cache, block_tables, min(query.shape[0], out.shape[0]))
    args = (_DTYPE_CODES[query.dtype], out.data_ptr(), out.stride(0), query.data_ptr(),
            query.stride(0), token_rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.stride(0), lens.data_ptr(), bt_rows.data_ptr(),
            lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale)
    if sliding_window is None and soft_cap is None:
        rc = _library().pagellm_paged_attention(*args, ctypes.byref(bounds))
    else:
        rc = _library().pagellm_paged_attention_windowed(
            *args, sliding_window or 0, soft_cap or 0.0, ctypes.byref(bounds))
    if rc == _OUT_OF_BOUNDS:
        raise _out_of_bounds(what, bounds)
    if rc != 1:
        raise ValueError(_shape_refused(what, num_heads, num_kv_heads, head_dim, block_size))


def paged_attention_supports(num_heads: int, num_kv_heads: int, head_dim: int,
                             block_size: int) -> bool:
    """Whether ``paged_attention`` takes this shape: every size positive, the query heads whole
    groups of the kv heads (any block size: one the AMX path cannot tile takes the vector
    path)."""
    return (_library() is not None and bool(_lib.pagellm_paged_attention_supported(
        0, num_heads, num_kv_heads, head_dim, block_size)))


def _shape_refused(what: str, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int) -> str:
    return (f"cpu_ops.{what}: the kernel refuses {num_heads} query heads over {num_kv_heads} "
            f"kv heads, head_dim {head_dim}, --block-size {block_size} (every size must be "
            "positive and the query heads whole groups of the kv heads)")


def paged_attention_slices(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                           dtype: torch.dtype) -> list[tuple[int, int]]:
    """For tests: how ``paged_attention`` slices a block's prefetches for this shape, as
    ``(cache lines, lines per slice)`` per 16-token tile, per query head and per kv head."""
    out = (c_int64 * 6)()
    if not _library().pagellm_paged_attention_slices(_DTYPE_CODES[dtype], num_heads,
                                                     num_kv_heads, head_dim, block_size, out):
        raise ValueError(_shape_refused("paged_attention_slices", num_heads, num_kv_heads,
                                        head_dim, block_size))
    return [(out[0], out[1]), (out[2], out[3]), (out[4], out[5])]
