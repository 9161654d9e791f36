"""The state cache of recurrent layers: per layer, each state tensor for every slot.

A slot (core/state_slots.py) holds one request's state in every recurrent layer (slots past
the running ones hold prefix-cache snapshots, core/state_snapshots.py): e.g. for a
Gated DeltaNet layer the conv window ``[conv_dim, kernel - 1]`` (model dtype) and the recurrent
state ``[v_heads, k_head_dim, v_head_dim]`` (float32). Tensors are ``[num_slots + 1, ...]``:
slot ``num_slots`` is scratch, for profiling and warm-up runs that own no slot. Nothing is
zeroed: a sequence that starts (``has_initial_state`` False) never reads its slot.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pagellm.attention.state_metadata import StateMetadata
from pagellm.config import EngineConfig
from pagellm.core.sched_output import SchedulerOutput
from pagellm.memory_plan import state_snapshot_plan


def state_bytes_per_slot(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of one slot over every recurrent layer on one tensor-parallel rank."""
    layers = len(config.model.kv_cache_layout().state_layers)
    model_bytes = torch.tensor([], dtype=dtype).element_size()
    shapes = config.model.recurrent_state_shapes(config.parallel.tensor_parallel_size)
    per_layer = sum(math.prod(shape) * (4 if fp32 else model_bytes) for shape, fp32 in shapes)
    return layers * per_layer


def uses_state_snapshots(config: EngineConfig) -> bool:
    """Prefix caching on a model with recurrent layers: their state is snapshotted."""
    return bool(config.num_state_slots and config.cache.enable_prefix_caching)


def snapshot_layout(config: EngineConfig, num_blocks: int) -> tuple[int, int]:
    """``(snapshot slots, interval in blocks)`` for a pool of ``num_blocks`` KV blocks
    (memory_plan.state_snapshot_plan); ``(0, 1)`` without snapshots. The worker allocates by
    it, the scheduler hands the slots out by it."""
    if not uses_state_snapshots(config):
        return 0, 1
    from pagellm.worker.kv_cache import config_kv_bytes_per_token

    block_bytes = config_kv_bytes_per_token(config) * config.cache.block_size
    return state_snapshot_plan(num_blocks, block_bytes,
                               state_bytes_per_slot(config, config.model.dtype),
                               config.cache.block_size)


def allocate_state_caches(config: EngineConfig, num_slots: int, device: torch.device,
                          dtype: torch.dtype) -> dict[int, tuple[torch.Tensor, ...]]:
    """Per recurrent layer index, views of one ``[layers, num_slots + 1, *shape]`` tensor per
    kind of state; empty for models without recurrent layers."""
    layers = config.model.kv_cache_layout().state_layers
    if not layers or num_slots == 0:
        return {}
    shapes = config.model.recurrent_state_shapes(config.parallel.tensor_parallel_size)
    bases = [torch.empty((len(layers), num_slots + 1, *shape),
                         dtype=torch.float32 if fp32 else dtype, device=device)
             for shape, fp32 in shapes]
    return {layer: tuple(base[i] for base in bases) for i, layer in enumerate(layers)}


def state_cache_bytes(state_caches: dict[int, tuple[torch.Tensor, ...]]) -> int:
    return sum(t.numel() * t.element_size() for ts in state_caches.values() for t in ts)


def restore_state_snapshots(state_caches: dict[int, tuple[torch.Tensor, ...]],
                            restores: list[tuple[int, int]], device: torch.device) -> None:
    """Copy snapshot slots into requests' slots, ``(from, to)`` pairs, in every layer (a
    prefix hit's state; before the step that continues from it)."""
    src = torch.tensor([a for a, _ in restores], dtype=torch.long, device=device)
    dst = torch.tensor([b for _, b in restores], dtype=torch.long, device=device)
    for tensors in state_caches.values():
        for t in tensors:
            t.index_copy_(0, dst, t.index_select(0, src))


def step_state_metadata(so: SchedulerOutput, seqs: list[tuple[str, int]],
                        query_start_loc: list[int], num_computed: np.ndarray) -> StateMetadata:
    """The step's ``(req_id, slot)`` sequences in batch order: each continues its slot's state
    when it has computed tokens before, and writes the snapshots the scheduler asked for."""
    checkpoints = ([so.state_checkpoints.get(r, []) for r, _ in seqs]
                   if so.state_checkpoints else None)
    return StateMetadata(query_start_loc, [slot for _, slot in seqs],
                         (num_computed > 0).tolist(), checkpoints)
