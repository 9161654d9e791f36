"""Tensor-level wrappers of the 8-bit KV cache kernels (``cpu_kv_quant.cpp``): quantized
writes and paged attention reading the quantized blocks (decode tokens and prefill chunks
alike).

The library is the one ``cpu_ops`` loads (``cpu_ops.library()``, so ``cpu_ops.built_for``
switches these too); ``supports`` says whether the kernels take a layer's tensors, callers fall
back to the torch reference (attention/kv_quant.py) otherwise.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm.attention.kv_quant import SCALE_DTYPE, KVQuant
from pagellm.kernels import cpu_ops

FORMATS = {"fp8_e4m3": 0, "fp8_e5m2": 1, "int8_per_token_head": 2}


class KVQuantLayer(ctypes.Structure):
    """One layer's quantized-cache state for ``llama_forward_quant`` (``PagellmKVQuantLayer``):
    int8's scale tables (None for fp8) and the per-tensor scales."""

    _fields_ = [("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p),
                ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float)]


class KVQuantStep(ctypes.Structure):
    """An 8-bit cache's step for ``llama_forward_quant`` (``PagellmKVQuantStep``): the format,
    the layers' ``KVQuantLayer`` table, and every sequence as (first row, rows, cached tokens,
    block-table row) like ``paged_attention``'s."""

    _fields_ = [("fmt", ctypes.c_int64), ("layers", ctypes.c_void_p),
                ("num_seqs", ctypes.c_int64),
                *((name, ctypes.c_void_p) for name in ("q_rows", "q_lens", "seq_lens",
                                                        "bt_rows"))]


def layer_state(quant: KVQuant) -> KVQuantLayer:
    """``quant`` as the fused step's per-layer entry."""
    return KVQuantLayer(_ptr(quant.k_scales), _ptr(quant.v_scales), quant.k_scale,
                        quant.v_scale)


def fused_supports(k_cache: torch.Tensor, v_cache: torch.Tensor, quant: KVQuant) -> bool:
    """Whether the fused step (``llama_forward_quant``) takes this layer's 8-bit caches: the
    checks of ``supports`` that do not depend on the step's activations."""
    if not (cpu_ops.available() and quant.kind in FORMATS and k_cache.is_cpu
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape
            and k_cache.element_size() == v_cache.element_size() == 1):
        return False
    if quant.kind == "int8_per_token_head":
        # [blocks (at least the cache's), block_size, kv_heads]
        return all(t is not None and t.dtype == SCALE_DTYPE and t.is_contiguous()
                   and t.dim() == 3 and t.shape[0] >= k_cache.shape[0]
                   and t.shape[1:] == k_cache.shape[1:3] for t in (quant.k_scales, quant.v_scales))
    return quant.k_scale > 0 and quant.v_scale > 0


def llama_forward(layers: ctypes.Array, shape: ctypes.Structure, step: ctypes.Structure,
                  quant: KVQuantStep) -> None:
    """``cpu_ops.llama_forward`` over 8-bit caches (``cpu_decoder.cpp``)."""
    rc = _lib().pagellm_llama_forward_quant(ctypes.byref(layers), len(layers),
                                            ctypes.byref(shape), ctypes.byref(step),
                                            ctypes.byref(quant))
    if rc == -1:
        raise IndexError("cpu_kv_quant.llama_forward: a slot, block id, block-table row or "
                         f"length lies outside the cache ({step.num_blocks} blocks) or the step; "
                         "nothing outside them was read or written")
    if rc != 1:
        raise RuntimeError("cpu_kv_quant.llama_forward cannot take this step here (the linears' "
                           "kernel or the quantized kernels refused it)")


def _lib() -> ctypes.CDLL:
    lib = cpu_ops.library()
    assert lib is not None, "call supports() first"
    return lib


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, quant: KVQuant) -> bool:
    """Whether the kernels take this layer's step: CPU float32/bfloat16 activations of one
    dtype, 8-bit caches of the kind's storage, unit stride in the last dimension."""
    if not (cpu_ops.available() and quant.kind in FORMATS
            and query.dtype in (torch.float32, torch.bfloat16)):
        return False
    acts = (query, key, value)
    if any(t.dtype != query.dtype or not t.is_cpu or t.stride(-1) != 1 for t in acts):
        return False
    if not (k_cache.is_cpu and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.element_size() == v_cache.element_size() == 1):
        return False
    if quant.kind == "int8_per_token_head":
        return all(t is not None and t.dtype == SCALE_DTYPE and t.is_contiguous()
                   for t in (quant.k_scales, quant.v_scales))
    return True


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slots: torch.Tensor, quant: KVQuant) -> None:
    """Quantize ``key/value [T, Hkv, D]`` (token rows may be strided) into flat ``slots``."""
    slots = slots.to(torch.int64).contiguous()
    num_kv_heads, head_dim = k_cache.shape[-2:]
    cpu_ops._check(key.stride(1) == head_dim and value.stride(1) == head_dim
                   and key.shape[1:] == value.shape[1:] == k_cache.shape[2:]
                   and slots.shape[0] >= key.shape[0] and v_cache.shape == k_cache.shape,
                   "write_kv_quant", "key/value must be [T, Hkv, D] (unit-stride heads) of the "
                   "cache's shape, one slot per token")
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = _lib().pagellm_write_kv_quant(
        FORMATS[quant.kind], cpu_ops.dtype_code(key.dtype), k_cache.data_ptr(),
        v_cache.data_ptr(), _ptr(quant.k_scales), _ptr(quant.v_scales), key.data_ptr(),
        key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(), key.shape[0],
        num_kv_heads, head_dim, num_slots, quant.k_scale, quant.v_scale)
    if rc == -1:
        raise IndexError(f"cpu_kv_quant.write_kv: a slot lies outside the cache's {num_slots} "
                         "slots; no token was written outside it")
    if rc != 1:
        raise ValueError(f"cpu_kv_quant.write_kv: the kernel refuses {quant.kind} with "
                         f"{key.dtype}, k_scale {quant.k_scale}, v_scale {quant.v_scale}")


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, quant: KVQuant, block_tables: torch.Tensor,
                    q_rows: torch.Tensor, q_lens: torch.Tensor, seq_lens: torch.Tensor,
                    bt_rows: torch.Tensor, scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None) -> None:
    """Causal attention over an 8-bit cache for a step's sequences (decode tokens are chunks of
    one row): sequence i's ``q_lens[i]`` query rows from row ``q_rows[i]`` are the last of its
    ``seq_lens[i]`` cached tokens, its blocks row ``bt_rows[i]`` of ``block_tables``; written
    into ``out`` at the same rows (``cpu_ops.prefill_attention``'s arguments)."""
    what = "paged_attention_quant"
    num_heads, head_dim = query.shape[1], query.shape[2]
    cpu_ops._check(query.stride(1) == head_dim and out.stride(1) == head_dim, what,
                   "query and out must have unit-stride heads")
    cpu_ops._check(block_tables.dtype == torch.int32 and block_tables.dim() == 2
                   and block_tables.stride(1) == 1, what, "block_tables must be int32")
    cpu_ops._check(q_lens.dtype == seq_lens.dtype == torch.int32
                   and q_rows.dtype == bt_rows.dtype == torch.int64
                   and all(t.is_contiguous() for t in (q_rows, q_lens, seq_lens, bt_rows))
                   and q_rows.shape == q_lens.shape == seq_lens.shape == bt_rows.shape, what,
                   "q_lens/seq_lens int32, q_rows/bt_rows int64, contiguous, of one shape")
    num_kv_heads, block_size = k_cache.shape[-2], k_cache.shape[1]
    bounds = cpu_ops._bounds(k_cache, v_cache, block_tables, min(query.shape[0], out.shape[0]))
    rc = _lib().pagellm_paged_attention_quant(
        FORMATS[quant.kind], cpu_ops.dtype_code(query.dtype), out.data_ptr(), out.stride(0),
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        _ptr(quant.k_scales), _ptr(quant.v_scales), block_tables.data_ptr(),
        block_tables.stride(0), q_rows.shape[0], q_rows.data_ptr(), q_lens.data_ptr(),
        seq_lens.data_ptr(), bt_rows.data_ptr(), num_heads, num_kv_heads, head_dim, block_size,
        scale, sliding_window or 0, soft_cap or 0.0, quant.k_scale, quant.v_scale,
        ctypes.byref(bounds))
    if rc == -1:
        raise cpu_ops._out_of_bounds(what, bounds)
    if rc != 1:
        raise ValueError(cpu_ops._shape_refused(what, num_heads, num_kv_heads, head_dim,
                                                block_size))
