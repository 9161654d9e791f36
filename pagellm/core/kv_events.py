"""KV cache events, as the block pool records them (vLLM's names; pure Python, no zmq).

A subscriber that applies them in order (``BlockStored`` adds hashes, ``BlockRemoved`` drops
them, ``AllBlocksCleared`` forgets them all) holds exactly the block pool's set of cached block
hashes. Each ``BlockStored`` is one chain: ``block_hashes[0]``'s parent is
``parent_block_hash`` (None for a prompt's first block), each later hash's parent the hash
before it, and ``token_ids`` holds the blocks' tokens, ``block_size`` per block.
engine/kv_events.py puts them on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.block_hash import BlockHash

# vLLM's MEDIUM_GPU: the engine's own KV cache (as opposed to an offloaded tier), whatever the
# device; a router weighs "GPU" hits as full ones.
MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # pagellm serves no LoRA adapters: always None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
