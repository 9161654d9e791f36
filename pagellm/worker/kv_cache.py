"""KV cache budget per device and the allocation of per-layer K/V block tensors."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from pagellm.attention.kv_quant import SCALE_DTYPE, KVQuant, storage_dtype
from pagellm.config import EngineConfig
from pagellm.core.sched_output import SchedulerOutput
from pagellm.memory_plan import (
    GiB,
    KVCachePlan,
    check_fits,
    cpu_memory_budget,
    cuda_memory_budget,
    kv_bytes_per_token,
    log_plan,
    plan_kv_cache,
)

logger = logging.getLogger("pagellm")


def config_kv_bytes_per_token(config: EngineConfig) -> int:
    """KV bytes of one token in one block: every layer's, or with several KV cache groups the
    ``group_size`` layers a block holds (core/kv_cache_groups.py), at --kv-cache-dtype."""
    m = config.model
    kv_dtype = config.cache.kv_cache_dtype
    model_bytes = torch.tensor([], dtype=m.dtype).element_size()
    return kv_bytes_per_token(m.kv_cache_layout().num_tensors, m.num_kv_heads, m.head_dim,
                              kv_dtype.element_bytes(model_bytes),
                              config.parallel.tensor_parallel_size, kv_dtype.scale_bytes())


def cache_storage_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the K/V cache tensors at --kv-cache-dtype (``model_dtype`` for auto)."""
    kind = config.cache.kv_cache_dtype.kind
    if kind in ("bfloat16", "float16"):
        return getattr(torch, kind)
    if config.cache.kv_cache_dtype.quantized:
        return storage_dtype(kind)
    return model_dtype


def plan_for_device(config: EngineConfig, weight_bytes: int,
                    profile_peak_activation: Callable[[], int],
                    cuda_graph_bytes: Callable[[int], int] | None = None,
                    draft_kv_bytes_per_token: int = 0, state_bytes: int = 0,
                    snapshot_share: float = 0.0) -> KVCachePlan:
    """CPU: the explicit --kv-cache-memory, or a safe share of free RAM. CUDA: the part of
    gpu_memory_utilization x total memory left after weights, peak activations (measured by a
    profiling forward), memory outside torch and the decode CUDA graphs (``cuda_graph_bytes``:
    peak activation bytes -> an estimate, as the graphs are captured after the KV cache).
    ``draft_kv_bytes_per_token``: a draft model's cache (spec_decode/draft_model.py), whose
    blocks share the target's ids: a block costs both, so one budget bounds both caches.
    ``state_bytes``: the recurrent layers' state slots (worker/state_cache.py), taken from the
    same budget before it is cut into blocks; ``snapshot_share``: the part of the rest kept
    for their prefix-cache snapshots (worker/state_cache.snapshot_layout)."""
    device = config.device.device
    per_token = config_kv_bytes_per_token(config) + draft_kv_bytes_per_token
    if draft_kv_bytes_per_token:
        logger.info("KV bytes/token: target %d + draft model %d",
                    per_token - draft_kv_bytes_per_token, draft_kv_bytes_per_token)
    cache = config.cache
    if device.type == "cuda":
        activation = profile_peak_activation()
        free, total = torch.cuda.mem_get_info(device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
        graphs = cuda_graph_bytes(activation) if cuda_graph_bytes is not None else 0
        budget = cuda_memory_budget(total, cache.gpu_memory_utilization, weight_bytes,
                                    activation, non_torch, graphs)
        logger.info("GPU memory: total %.2f GiB x %.2f; weights %.2f GiB, peak activations "
                    "%.2f GiB, non-torch %.2f GiB, CUDA graphs %.2f GiB (estimate) -> KV "
                    "%.2f GiB", total / GiB, cache.gpu_memory_utilization, weight_bytes / GiB,
                    activation / GiB, non_torch / GiB, graphs / GiB,
                    budget.kv_budget_bytes / GiB)
        flag = "--gpu-memory-utilization"
    else:
        budget = cpu_memory_budget(cache.kv_cache_memory, weight_bytes)
        flag = "--kv-cache-memory"
    if state_bytes:
        if state_bytes >= budget.kv_budget_bytes:
            raise ValueError(
                f"the recurrent state of {config.num_state_slots} sequences needs "
                f"{state_bytes / GiB:.2f} GiB, more than the KV budget of "
                f"{budget.kv_budget_bytes / GiB:.2f} GiB: lower --max-num-seqs or raise {flag}")
        logger.info("Recurrent state: %d slots, %.2f GiB of the KV budget", config.num_state_slots,
                    state_bytes / GiB)
        rest = budget.kv_budget_bytes - state_bytes
        budget = dataclasses.replace(budget, kv_budget_bytes=int(rest * (1 - snapshot_share)))
    layout = config.model.kv_cache_layout()
    request_blocks = 0
    if layout.num_groups > 1 or layout.groups[0].sliding_window is not None:
        request_blocks = layout.blocks_for_tokens(config.model.max_model_len, cache.block_size,
                                                  config.scheduler.max_num_batched_tokens)
    plan = plan_kv_cache(budget.kv_budget_bytes, per_token, cache.block_size,
                         config.model.max_model_len, cache.num_gpu_blocks_override,
                         request_blocks)
    log_plan(plan, str(device), cache.cache_dtype)
    from pagellm.planning.report import log_planned_vs_measured

    log_planned_vs_measured(config, budget, plan)  # `pagellm plan`'s table, measured beside
    check_fits(plan, flag)
    return plan


def allocate_kv_caches(config: EngineConfig, num_blocks: int, device: torch.device,
                       dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (k_cache, v_cache) views of one
    ``[layers, 2, num_blocks + 2, block_size, kv_heads, head_dim]`` tensor.

    Only the two extra blocks are zeroed here: the runner zeroes every block when it is handed
    out (zero_new_blocks) where the attention backend reads unwritten slots (the
    CPU kernels never do), so the pool itself is left uninitialized. That makes
    allocation instant (zeroing a multi-GiB CPU pool takes seconds and commits all its pages)
    and memory is touched only as blocks are used; the block pool hands freed blocks out again
    first (BlockPool.free_blocks), so the touched part stays as large as the peak load.

    Block ``num_blocks`` is the null block: never handed out, always zero; block tables are
    padded with it, so padded positions read zeros (see zero_new_blocks).
    Block ``num_blocks + 1`` is the scratch block: the padding rows of a CUDA-graph decode step
    write their K/V there and no block table names it (see worker/cuda_graphs.py).
    """
    from pagellm.memory_plan import kv_heads_per_rank

    m = config.model
    heads = kv_heads_per_rank(m.num_kv_heads, config.parallel.tensor_parallel_size)
    # With several KV cache groups the tensors are fewer than the layers: layer j of every
    # group shares tensor j (a block id belongs to one group at a time).
    layout = m.kv_cache_layout()
    shape = (layout.num_tensors, 2, num_blocks + 2, config.cache.block_size, heads, m.head_dim)
    kv = torch.empty(shape, dtype=cache_storage_dtype(config, dtype), device=device)
    kv[:, :, num_blocks:].zero_()
    # A recurrent layer (tensor -1) has no KV: an empty pair keeps the list indexed by layer.
    none = kv[:0, 0, :0]
    return [(kv[t, 0], kv[t, 1]) if t >= 0 else (none, none) for t in layout.tensor_of_layer]


def allocate_kv_quant(config: EngineConfig, num_blocks: int, device: torch.device,
                      layer_scales: dict[int, tuple[float, float]]) -> list[KVQuant] | None:
    """Per layer, the KVQuant of an 8-bit --kv-cache-dtype (None for float caches):
    ``layer_scales`` the per-tensor (k_scale, v_scale) of each layer (fp8), and for
    int8_per_token_head views of one zeroed bfloat16 ``[tensors, 2, num_blocks + 2,
    block_size, kv_heads]`` scale tensor, shared by the layers that share a cache tensor.
    Zeroed, so a slot never written dequantizes to 0 (its int8 values are zeroed with the
    block, or garbage)."""
    from pagellm.memory_plan import kv_heads_per_rank

    kv_dtype = config.cache.kv_cache_dtype
    if not kv_dtype.quantized:
        return None
    m = config.model
    layout = m.kv_cache_layout()
    scales = None
    if kv_dtype.per_token_head:
        heads = kv_heads_per_rank(m.num_kv_heads, config.parallel.tensor_parallel_size)
        scales = torch.zeros((layout.num_tensors, 2, num_blocks + 2, config.cache.block_size,
                              heads), dtype=SCALE_DTYPE, device=device)
    out = []
    for layer, t in enumerate(layout.tensor_of_layer):
        k_scale, v_scale = layer_scales.get(layer, (1.0, 1.0))
        own = scales is not None and t >= 0
        out.append(KVQuant(kv_dtype.kind, k_scale, v_scale,
                           scales[t, 0] if own else None, scales[t, 1] if own else None))
    return out


def layer_kv_scales(model: torch.nn.Module) -> dict[int, tuple[float, float]]:
    """Each attention layer's per-tensor (k_scale, v_scale), by layer index (1.0 unless the
    checkpoint carried them: models/kv_scales.py)."""
    from pagellm.layers.attention import Attention

    return {m.layer_idx: (float(m.k_scale), float(m.v_scale))
            for m in model.modules() if isinstance(m, Attention)}


def kv_quant_bytes(kv_quant: list[KVQuant] | None) -> int:
    """The bytes of the int8 scale tensors ``allocate_kv_quant`` made (0 for fp8 or None)."""
    if not kv_quant or kv_quant[0].k_scales is None:
        return 0
    base = kv_quant[0].k_scales._base
    return base.numel() * base.element_size() if base is not None else 0


def zero_new_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], so: SchedulerOutput,
                    block_size: int, device: torch.device) -> None:
    """Zero the blocks handed out this step (not prefix-cache hits), so every slot a request
    has not written yet reads 0, like the null block padding its table: attention then needs no
    masking copies of gathered K/V (stale data of a block's last owner never leaks)."""
    ids: list[int] = []
    for new in so.scheduled_new_reqs:
        ids += new.block_ids[new.num_computed_tokens // block_size:]
        for group in new.group_block_ids:
            ids += group[new.num_computed_tokens // block_size:]
    for block_ids in so.scheduled_cached_reqs.new_block_ids:
        ids += block_ids
    for groups in so.scheduled_cached_reqs.new_group_block_ids:
        for block_ids in groups:
            ids += block_ids
    if not ids or not kv_caches:
        return
    index = torch.tensor(ids, dtype=torch.long, device=device)
    # All layers' K and V are views of one tensor [layers, 2, blocks, ...].
    base = kv_cache_base(kv_caches)
    if base is not None:
        base.index_fill_(2, index, 0)
        return
    for k, v in kv_caches:
        if k.numel():  # not a recurrent layer's empty pair
            k.index_fill_(0, index, 0)
            v.index_fill_(0, index, 0)


def kv_cache_base(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """The ``[layers, 2, blocks, ...]`` tensor ``allocate_kv_caches``' views share, or None
    (no cache, or per-layer tensors of their own)."""
    # A recurrent layer's pair is empty (allocate_kv_caches): look at an attention layer's.
    k0 = next((k for k, _ in kv_caches if k.numel()), None)
    if k0 is None:
        return None
    base = k0._base
    return base if base is not None and base.dim() == k0.dim() + 2 else None


def kv_cache_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The bytes ``allocate_kv_caches`` allocated for these views (the whole tensor they share,
    null and scratch blocks included), or their own bytes where they share none."""
    base = kv_cache_base(kv_caches)
    if base is not None:
        return base.numel() * base.element_size()
    return sum(t.numel() * t.element_size() for kv in kv_caches for t in kv)
