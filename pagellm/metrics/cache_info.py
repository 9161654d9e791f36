"""The labels of ``cache_config_info``: vLLM's CacheConfig fields that pagellm has, as strings
(vLLM exports ``str()`` of each field), so tools that read vLLM's (an endpoint picker reading
block_size, say) find the same keys and spellings."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagellm.config import CacheConfig


def cache_config_info(cache: CacheConfig, num_gpu_blocks: int | None) -> dict[str, str]:
    """``num_gpu_blocks``: the KV blocks the engine allocated (on any device: vLLM's name)."""
    return {
        "block_size": str(cache.block_size),
        # --kv-cache-dtype as given (vLLM's spelling: "auto" is the model's dtype).
        "cache_dtype": cache.cache_dtype,
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "prefix_caching_hash_algo": cache.prefix_caching_hash_algo,
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "num_gpu_blocks_override": str(cache.num_gpu_blocks_override),
        "kv_cache_memory_bytes": str(cache.kv_cache_memory),
        "num_gpu_blocks": str(num_gpu_blocks),
    }
