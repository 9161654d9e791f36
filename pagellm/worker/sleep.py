"""Sleep mode on one rank (vLLM's ``LLM.sleep``/``wake_up``): hand the KV cache, and at level 2
the weights, back to the system between RL rollouts, and rebuild them on wake.

Level 1 frees the KV cache and keeps the weights where they are (vLLM offloads them to CPU
memory; on a CPU engine they already are there). Level 2 frees the weights too; ``wake_up``
then reloads them from the model's checkpoint, so weights given with ``load_weights`` before
the sleep are lost: load them again after waking. A draft model (speculative decoding) sleeps
and wakes with the target: its cache, and at level 2 its weights.

Memory returns to the system by dropping every reference to the tensors (the fused CPU step's
table and the CUDA graphs hold the KV cache's addresses, so they go too) and, on CUDA, emptying
the caching allocator.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from typing import Any

import torch

from pagellm.models.llama_cpu_fused import enable_fused_cpu_forward
from pagellm.worker.kv_cache import (
    allocate_kv_caches,
    allocate_kv_quant,
    kv_cache_bytes,
    kv_quant_bytes,
    layer_kv_scales,
)
from pagellm.worker.state_cache import allocate_state_caches, state_cache_bytes

logger = logging.getLogger("pagellm")

# The ModelRunner (not imported: it imports this module); Any keeps the two acyclic.
ModelRunner = Any

SLEEP_LEVELS = (1, 2)


def _release_memory(device: torch.device) -> None:
    gc.collect()  # the model's modules hold cycles (parent/child, shared workspaces)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return
    try:
        # Many small weight tensors live in malloc's heap, not in their own mmaps: give its
        # free pages back too.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: large blocks are still unmapped on free


def sleep_runner(runner: ModelRunner, level: int) -> int:
    """Free the KV cache (level 1) and the weights (level 2); returns the bytes freed. A deeper
    level than the current one frees what is left; a lighter one does nothing."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if level <= runner.sleep_level:
        return 0
    freed = 0
    runner.graph_runner = None  # captured against the KV cache and weights' addresses
    freed += (kv_cache_bytes(runner.kv_caches) + kv_quant_bytes(runner.kv_quant)
              + state_cache_bytes(runner.state_caches))
    runner.kv_caches = []
    runner.kv_quant = None
    runner.state_caches = {}
    if runner.spec_decode is not None:
        freed += runner.spec_decode.sleep(level)  # a draft model's cache and weights
    if level == 2 and runner.model is not None:
        freed += sum(p.numel() * p.element_size() for p in runner.model.parameters())
        runner.model = None  # type: ignore[assignment]  # wake_up loads it again
    elif runner.model is not None:
        enable_fused_cpu_forward(runner.model)  # a fresh fused step: the old one's table held KV
    _release_memory(runner.device)
    runner.sleep_level = level
    logger.info("Sleeping (level %d): freed %.1f MiB", level, freed / 2**20)
    return freed


def wake_runner(runner: ModelRunner) -> int:
    """Bring back what ``sleep_runner`` freed: the weights from the checkpoint (level 2), a KV
    cache of the same number of blocks (its contents are gone: the engine resets the prefix
    cache on sleep), the fused CPU step's table (built at its next step against the new cache)
    and the decode CUDA graphs (re-captured). Returns the level it woke from.

    NOTE: the CUDA paths (empty_cache, re-capture) have not been run on a GPU yet."""
    level = runner.sleep_level
    if level == 0:
        return 0
    if runner.model is None:
        runner.model = runner.load_model()
    runner.kv_caches = allocate_kv_caches(runner.config, runner.num_blocks, runner.device,
                                          runner.dtype)
    runner.kv_quant = allocate_kv_quant(runner.config, runner.num_blocks, runner.device,
                                        layer_kv_scales(runner.model))
    runner.state_caches = allocate_state_caches(runner.config, runner.num_state_slots,
                                                runner.device, runner.dtype)
    enable_fused_cpu_forward(runner.model)
    if runner.spec_decode is not None:
        runner.spec_decode.wake_up()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    runner.capture_graphs()
    runner.sleep_level = 0
    logger.info("Awake (from sleep level %d)", level)
    return level
