"""KV cache sizing: the one piece of arithmetic shared by the engine's start-up (worker/) and
`pagellm plan` (planning/), so it sits below both.

KV bytes per token = 2 (K and V) x layers x kv_heads (on this rank) x (head_dim x value bytes
+ scale bytes): the value bytes of --kv-cache-dtype (1 for the 8-bit ones), plus 4 for the scale
of each (token, head) row with int8_per_token_head.
KV budget on CUDA = gpu_memory_utilization x total - weights - peak activations - non-torch memory
- CUDA graphs (estimated before capture, see worker/cuda_graphs.py); on CPU it is the explicit
--kv-cache-memory or a safe share of the free RAM. The engine fills a MemoryBudget with measured
numbers, `pagellm plan` with estimates; both then call plan_kv_cache.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

logger = logging.getLogger("pagellm")

GiB = 1 << 30
# CPU default: a quarter of the memory available at start-up, at most this much.
DEFAULT_CPU_KV_FRACTION = 0.25
DEFAULT_CPU_KV_CAP = 8 * GiB


# With prefix caching on a model with recurrent layers: the share of the KV budget (after the
# running sequences' state slots) given to state snapshots (core/state_snapshots.py).
STATE_SNAPSHOT_SHARE = 0.2
# Tokens between two snapshots: at least one scan chunk (a snapshot splits the scan there), at
# most this many (a hit recomputes up to one interval).
STATE_SNAPSHOT_INTERVAL_TOKENS = (64, 512)


def state_snapshot_plan(num_blocks: int, block_bytes: int, slot_bytes: int,
                        block_size: int) -> tuple[int, int]:
    """``(snapshot slots, interval in blocks)`` for a pool of ``num_blocks`` KV blocks: the
    snapshots take STATE_SNAPSHOT_SHARE of what blocks and snapshots take together, one every
    ``interval`` blocks: as many as cover the whole pool's worth of tokens, within
    STATE_SNAPSHOT_INTERVAL_TOKENS. Where they cover less, LRU eviction keeps the newest (the
    end of each recent history; earlier ones are never hit again). A function of the block
    count alone, so the scheduler finds the worker's numbers again."""
    if slot_bytes <= 0 or num_blocks <= 0:
        return 0, 1
    share = STATE_SNAPSHOT_SHARE / (1 - STATE_SNAPSHOT_SHARE)
    slots = int(num_blocks * block_bytes * share // slot_bytes)
    if slots < 1:
        return 0, 1
    lo, hi = (max(1, -(-t // block_size)) for t in STATE_SNAPSHOT_INTERVAL_TOKENS)
    return slots, min(max(-(-num_blocks // slots), lo), hi)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """K/V heads split across ranks; replicated when there are fewer heads than ranks."""
    return max(1, num_kv_heads // tp_size)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                       tp_size: int = 1, scale_bytes: int = 0) -> int:
    """``dtype_bytes``: of one stored value (1 for an 8-bit --kv-cache-dtype); ``scale_bytes``:
    stored beside each (token, kv head) row (int8_per_token_head's float32 scale)."""
    heads = kv_heads_per_rank(num_kv_heads, tp_size)
    return 2 * num_layers * heads * (head_dim * dtype_bytes + scale_bytes)


@dataclass(frozen=True)
class KVCachePlan:
    kv_budget_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_model_len: int
    # Blocks one request of max_model_len holds at its peak, when that is not
    # ceil(max_model_len / block_size): models with sliding-window KV cache groups
    # (KVCacheLayout.blocks_for_tokens). 0: the plain count.
    max_len_request_blocks: int = 0

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_max_len_request(self) -> int:
        return self.max_len_request_blocks or math.ceil(self.max_model_len / self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit at once."""
        return self.num_blocks / self.blocks_per_max_len_request

    @property
    def fits(self) -> bool:
        return self.num_blocks >= self.blocks_per_max_len_request

    def as_dict(self) -> dict[str, float | int | bool]:
        out: dict[str, float | int | bool] = asdict(self)
        out.update(token_capacity=self.token_capacity, max_concurrency=self.max_concurrency,
                   fits=self.fits)
        return out


def plan_kv_cache(kv_budget_bytes: int, kv_bytes_per_token: int, block_size: int,
                  max_model_len: int, num_blocks_override: int | None = None,
                  max_len_request_blocks: int = 0) -> KVCachePlan:
    """``kv_bytes_per_token``: of one block-table slot (with KV cache groups, a block holds
    ``group_size`` layers, see core/kv_cache_groups.py); ``max_len_request_blocks``: see
    KVCachePlan."""
    bytes_per_block = kv_bytes_per_token * block_size
    num_blocks = num_blocks_override or max(0, kv_budget_bytes // bytes_per_block)
    return KVCachePlan(kv_budget_bytes=kv_budget_bytes, kv_bytes_per_token=kv_bytes_per_token,
                       block_size=block_size, num_blocks=int(num_blocks),
                       max_model_len=max_model_len,
                       max_len_request_blocks=max_len_request_blocks)


def check_fits(plan: KVCachePlan, budget_flag: str) -> None:
    """Refuse to start when one request of max_model_len cannot fit, with the numbers and fixes."""
    if plan.fits:
        return
    need = plan.blocks_per_max_len_request * plan.bytes_per_block
    raise ValueError(
        f"--max-model-len {plan.max_model_len} does not fit in the KV cache: one such request "
        f"needs {plan.blocks_per_max_len_request} blocks ({need / GiB:.2f} GiB), but the KV budget "
        f"of {plan.kv_budget_bytes / GiB:.2f} GiB holds only {plan.num_blocks} blocks "
        f"({plan.token_capacity} tokens). Lower --max-model-len to at most "
        f"{plan.token_capacity}, or raise {budget_flag}.")


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); falls back to 8 GiB where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


def default_cpu_kv_budget(available_bytes: int | None = None) -> int:
    """A quarter of the available host memory (measured now unless given), at most 8 GiB."""
    available = available_host_memory() if available_bytes is None else available_bytes
    return max(0, int(min(DEFAULT_CPU_KV_CAP, DEFAULT_CPU_KV_FRACTION * available)))


@dataclass(frozen=True)
class MemoryBudget:
    """Where one rank's memory goes. On CPU the KV budget is explicit, so activations and
    overhead are not subtracted (None when not measured)."""

    device_type: str  # "cpu" or "cuda"
    total_bytes: int  # one GPU's memory, or the host memory available
    gpu_memory_utilization: float | None
    weight_bytes: int
    activation_bytes: int | None
    non_torch_bytes: int | None
    kv_budget_bytes: int
    cuda_graph_bytes: int = 0  # reserved for decode CUDA graphs (estimated before capture)

    def as_dict(self) -> dict[str, float | int | str | None]:
        return asdict(self)


def cuda_memory_budget(total_bytes: int, gpu_memory_utilization: float, weight_bytes: int,
                       activation_bytes: int, non_torch_bytes: int,
                       cuda_graph_bytes: int = 0) -> MemoryBudget:
    usable = int(total_bytes * gpu_memory_utilization)
    kv = max(0, usable - weight_bytes - activation_bytes - non_torch_bytes - cuda_graph_bytes)
    return MemoryBudget("cuda", total_bytes, gpu_memory_utilization, weight_bytes,
                        activation_bytes, non_torch_bytes, kv, cuda_graph_bytes)


def cpu_memory_budget(kv_cache_memory: int | None, weight_bytes: int,
                      available_bytes: int | None = None,
                      activation_bytes: int | None = None) -> MemoryBudget:
    """``available_bytes``: host memory free once the weights are loaded (measured now when
    None, which is what the engine does after loading them)."""
    available = available_host_memory() if available_bytes is None else available_bytes
    kv = kv_cache_memory or default_cpu_kv_budget(available)
    return MemoryBudget("cpu", available, None, weight_bytes, activation_bytes, None, kv)


def log_plan(plan: KVCachePlan, device: str, kv_cache_dtype: str = "auto") -> None:
    logger.info(
        "KV cache on %s (--kv-cache-dtype %s): %.2f GiB budget, %d bytes/token, %d blocks of %d "
        "tokens -> %d tokens; max concurrency at max_model_len %d: %.2fx",
        device, kv_cache_dtype, plan.kv_budget_bytes / GiB, plan.kv_bytes_per_token,
        plan.num_blocks,
        plan.block_size, plan.token_capacity, plan.max_model_len, plan.max_concurrency)
