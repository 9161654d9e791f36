"""The CPU attention backend: decode tokens read K/V in place through block tables (C++ kernel).

Per step: every new K/V is written to its slot by one kernel call (strided rows straight from
the QKV projection, no copies); all decode tokens of the batch are attended by one kernel call
that reads each sequence's blocks where they lie, parallel over sequences. Prefill chunks are one
more call where a prefill kernel takes the dtype and head size: flash style over the cache
(``cpu_prefill.cpp``: AMX in bfloat16; ``cpu_prefill_vec.cpp``: AVX-512 in either dtype);
otherwise SDPA, a chunk with no cached context attending its own new K/V directly, one with
context gathering its blocks (the torch backend's path).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.kv_quant import KVQuant
from pagellm.attention.torch_backend import (
    TorchAttentionBackend,
    causal_attention,
    split_decode_prefill,
)
from pagellm.kernels import cpu_kv_quant, cpu_ops


@dataclass(slots=True)
class _StepPlan:
    """What every layer of one step needs, computed once per step (the first layer builds it
    and keeps it on the step's metadata).

    One kernel item per decode token: ``token_rows`` (its row in the batch), ``lens`` (how many
    cached tokens it attends to) and ``bt_rows`` (its sequence's row of ``block_tables``).
    """

    token_rows: torch.Tensor  # int64 [items]
    lens: torch.Tensor  # int32 [items]
    bt_rows: torch.Tensor  # int64 [items]
    prefill_seqs: list[int]  # chunks of more than one token
    block_tables: torch.Tensor  # int32, unit stride
    # The prefill chunks for cpu_ops.prefill_attention: first row, rows, cached tokens after
    # the chunk, block-table row.
    prefill_rows: torch.Tensor  # int64
    prefill_lens: torch.Tensor  # int32
    prefill_ctx: torch.Tensor  # int32
    prefill_bt_rows: torch.Tensor  # int64
    # Every sequence of the step as (first row, rows, length, block-table row), decodes first,
    # for the 8-bit cache kernel; built by the first quantized layer.
    quant_seqs: tuple[torch.Tensor, ...] | None = None


def quant_seqs(plan: _StepPlan) -> tuple[torch.Tensor, ...]:
    """(q_rows, q_lens, seq_lens, bt_rows) of the step's decode tokens (chunks of one row)
    followed by its prefill chunks."""
    if plan.quant_seqs is None:
        ones = torch.ones_like(plan.lens)
        plan.quant_seqs = (torch.cat([plan.token_rows, plan.prefill_rows]),
                           torch.cat([ones, plan.prefill_lens]),
                           torch.cat([plan.lens, plan.prefill_ctx]),
                           torch.cat([plan.bt_rows, plan.prefill_bt_rows]))
    return plan.quant_seqs


def plan_step(meta: AttentionMetadata) -> _StepPlan:
    """The step's plan, built by the first layer that asks and shared by the others."""
    if meta.step_plan is not None:
        return meta.step_plan
    starts = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
    decode_seqs, prefill_seqs = split_decode_prefill(meta)
    seq_of_row = np.asarray(decode_seqs, dtype=np.int64)
    rows = starts[seq_of_row]
    lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)[seq_of_row]
    block_tables = meta.block_tables
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    pre = np.asarray(prefill_seqs, dtype=np.int64)
    plan = _StepPlan(
        token_rows=torch.from_numpy(rows),
        lens=torch.from_numpy(lens.astype(np.int32)),
        bt_rows=torch.from_numpy(seq_of_row),
        prefill_seqs=prefill_seqs,
        block_tables=block_tables,
        prefill_rows=torch.from_numpy(starts[pre]),
        prefill_lens=torch.from_numpy((starts[pre + 1] - starts[pre]).astype(np.int32)),
        prefill_ctx=torch.from_numpy(
            np.asarray(meta.seq_lens_cpu, dtype=np.int64)[pre].astype(np.int32)),
        prefill_bt_rows=torch.from_numpy(pre),
    )
    meta.step_plan = plan
    return plan


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    @classmethod
    def needs_zeroed_blocks(cls, dtype: torch.dtype) -> bool:
        # The kernels read only the slots below each sequence's length, and the SDPA paths
        # slice to it; only the torch fallback (no kernels for this dtype) gathers padding.
        return not (cpu_ops.available() and cpu_ops.dtype_supported(dtype))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_quant: KVQuant | None = None,
    ) -> torch.Tensor:
        n = meta.num_tokens
        if kv_quant is not None:
            if not cpu_kv_quant.supports(query, key, value, k_cache, v_cache, kv_quant):
                return super().forward(query, key, value, k_cache, v_cache, meta, kv_quant)
            return self._forward_quant(query, key, value, k_cache, v_cache, meta, kv_quant)
        if not cpu_ops.supports(query, key, value, k_cache, v_cache):
            return super().forward(query, key, value, k_cache, v_cache, meta)
        # The decode kernel takes a window and a soft-cap; the prefill kernels take neither:
        # such layers' prefill chunks take the torch path below (it reads only the window).
        plain = self.sliding_window is None and self.logits_soft_cap is None
        cpu_ops.write_kv(key[:n], value[:n], k_cache, v_cache, meta.slot_mapping[:n])
        out = torch.empty((query.shape[0], self.num_heads, self.head_dim), dtype=query.dtype)
        plan = plan_step(meta)
        if plan.lens.numel():
            cpu_ops.paged_attention(out, query, k_cache, v_cache, plan.block_tables, plan.lens,
                                    plan.bt_rows, plan.token_rows, self.scale,
                                    self.sliding_window, self.logits_soft_cap)
        if plain and plan.prefill_seqs and cpu_ops.prefill_attention_supports(query, k_cache):
            cpu_ops.prefill_attention(out, query, k_cache, v_cache, plan.block_tables,
                                      plan.prefill_rows, plan.prefill_lens, plan.prefill_ctx,
                                      plan.prefill_bt_rows, self.scale)
            return out
        starts = meta.query_start_loc_cpu
        for i in plan.prefill_seqs:
            start, end = starts[i], starts[i + 1]
            if meta.seq_lens_cpu[i] == end - start:
                # No cached context: the chunk's own K/V are all it attends to.
                out[start:end] = causal_attention(query[start:end], key[start:end],
                                                  value[start:end], self.scale,
                                                  self.sliding_window, self.logits_soft_cap)
            else:
                out[start:end] = self._prefill(query[start:end], k_cache, v_cache,
                                               meta.block_tables[i], meta.seq_lens_cpu[i])
        return out

    def _forward_quant(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                       kv_quant: KVQuant) -> torch.Tensor:
        """An 8-bit cache (--kv-cache-dtype): quantized writes, then every sequence (decode
        tokens and prefill chunks, windowed and soft-capped too) in one call of the quantized
        kernel (kernels/cpu_kv_quant.cpp): decode rows dequantized in registers, prefill chunks
        a 64-key step of K/V at a time per tile of queries, never a float copy of the cache.
        It runs on every build (AVX-512 BF16/VNNI, AVX-512, or the plain loops); the fused step
        (models/llama_cpu_fused.py) calls the same kernels in the same order."""
        n = meta.num_tokens
        cpu_kv_quant.write_kv(key[:n], value[:n], k_cache, v_cache, meta.slot_mapping[:n],
                              kv_quant)
        out = torch.empty((query.shape[0], self.num_heads, self.head_dim), dtype=query.dtype)
        plan = plan_step(meta)
        q_rows, q_lens, seq_lens, bt_rows = quant_seqs(plan)
        if q_rows.numel():
            cpu_kv_quant.paged_attention(out, query, k_cache, v_cache, kv_quant,
                                         plan.block_tables, q_rows, q_lens, seq_lens, bt_rows,
                                         self.scale, self.sliding_window, self.logits_soft_cap)
        return out
