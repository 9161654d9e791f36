"""KV cache blocks, their LRU free queue and the hash -> cached block map (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagellm.core.block_hash import BlockHash
from pagellm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


# NOTE: eq=False: blocks compare by identity (field equality would walk the free links).
@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One KV cache block. A free block (ref_cnt 0) sits in the free queue through its intrusive
    ``prev_free_block``/``next_free_block`` links; ``block_hash`` is set while it is in the
    prefix cache (it may stay set on a free block until the block is reused: lazy eviction)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (front = evicted first).

    Fake head and tail sentinels keep every operation branch-free and O(1), including removing
    a block from the middle when a prefix hit revives a cached free block.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.fake_head.next_free_block
        assert first is not None
        if first is self.fake_tail:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._link(block, self.fake_tail.prev_free_block, self.fake_tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link(block, self.fake_head, self.fake_head.next_free_block)

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock | None,
              nxt: KVCacheBlock | None) -> None:
        """Insert ``block`` (in no queue) between the neighbours ``prev`` and ``nxt``."""
        assert block.prev_free_block is None and block.next_free_block is None
        assert prev is not None and nxt is not None
        prev.next_free_block = block
        block.prev_free_block = prev
        block.next_free_block = nxt
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front (next to evict) first. O(n): for tests and checks."""
        out = []
        cur = self.fake_head.next_free_block
        while cur is not None and cur is not self.fake_tail:
            out.append(cur)
            cur = cur.next_free_block
        return out


class BlockPool:
    """Owns every KV block: ref counts, the LRU free queue and the prefix-cache hash map.

    Contract: a block is in the free queue iff its ref count is 0. A cached block keeps its hash
    after being freed and can be revived by ``touch`` on a prefix hit; it leaves the hash map only
    when ``get_new_blocks`` hands it out again (lazy eviction, least recently freed first). With
    ``enable_caching=False`` a block drops its hash as soon as its ref count reaches 0, so hashed
    blocks (the n>1 siblings' shared prompt) are shared only while some request holds them.

    KV cache events (``enable_kv_cache_events``, with caching on; core/kv_events.py): every
    hash entering the map is recorded as a ``BlockStored``, every hash leaving it (eviction on
    reuse, ``uncache_blocks``) as a ``BlockRemoved``, a reset as ``AllBlocksCleared``, so the
    events replayed in order give exactly the map's keys. ``take_events`` drains them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool,
                 enable_kv_cache_events: bool = False, block_size: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        if enable_kv_cache_events and (block_size is None or block_size < 1):
            raise ValueError("KV cache events need the block size (the tokens of a block).")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # NOTE: one block per hash. A second block with the same content (computed while the
        # first was cached) stays unhashed, so the map always points at the block holding a hash.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.block_size = block_size
        # Events since the last take_events(); None when not recording (the only cost then).
        self.kv_event_queue: list[KVCacheEvent] | None = (
            [] if enable_kv_cache_events and enable_caching else None)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref count > 0), 0..1."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, least recently freed first, with ref count 1.

        A taken block that still carries a hash is evicted from the prefix cache right here.
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        removed: list[BlockHash] | None = [] if self.kv_event_queue is not None else None
        for block in blocks:
            assert block.ref_cnt == 0
            evicted = self._drop_hash(block)
            if evicted is not None and removed is not None:
                removed.append(evicted)
            block.ref_cnt = 1
        if removed:
            self._record(BlockRemoved(removed))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); revive free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. A block reaching 0 that holds a cached prefix joins
        the back of the free queue, in the given order (first = evicted first: callers pass a
        request's blocks tail first); one that holds nothing reusable goes to the front, to be
        handed out next: the pool's working set stays as small as the load (on the CPU a block
        never handed out is memory never touched, whose first write costs page faults that slow a
        prefill step), and it never evicts a cached
        block before one that holds nothing."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    self._drop_hash(block)
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
    ) -> list[KVCacheBlock]:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` (a request's full blocks) into the
        hash map under ``block_hashes[i]``. Blocks that are prefix hits already carry their hash;
        a block whose hash is already mapped to another block stays unhashed (no dedup).
        Returns the blocks that got a hash here. ``token_ids``: the request's tokens (at least
        the full blocks'), needed only when KV cache events are recorded."""
        assert num_full_blocks <= len(blocks) and num_full_blocks <= len(block_hashes)
        hashed = []
        stored: list[int] | None = [] if self.kv_event_queue is not None else None
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                assert block.block_hash == block_hash, "a block was hashed with other content"
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            hashed.append(block)
            if stored is not None:
                stored.append(i)
        if stored:
            assert token_ids is not None, "KV cache events need the blocks' token ids"
            self._record_stored(block_hashes, stored, token_ids)
        return hashed

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take these blocks out of the prefix cache (their K/V was never written)."""
        removed: list[BlockHash] = []
        for block in blocks:
            evicted = self._drop_hash(block)
            if evicted is not None:
                removed.append(evicted)
        if removed and self.kv_event_queue is not None:
            self._record(BlockRemoved(removed))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False, changes nothing) while any block is
        in use, since running requests' blocks must stay consistent with their hashes."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_event_queue is not None:
            self._record(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events recorded since the last call, oldest first (empty when off)."""
        events = self.kv_event_queue
        if not events:
            return []
        self.kv_event_queue = []
        return events

    def _record(self, event: KVCacheEvent) -> None:
        assert self.kv_event_queue is not None
        self.kv_event_queue.append(event)

    def _record_stored(self, block_hashes: Sequence[BlockHash], indices: list[int],
                       token_ids: Sequence[int]) -> None:
        """One BlockStored per run of consecutive newly hashed blocks (``indices``, ascending),
        so each event is one chain: a block skipped as already mapped breaks the run."""
        bs = self.block_size
        assert bs is not None
        start = prev = indices[0]
        for i in [*indices[1:], -1]:
            if i == prev + 1:
                prev = i
                continue
            self._record(BlockStored(
                block_hashes=list(block_hashes[start:prev + 1]),
                parent_block_hash=block_hashes[start - 1] if start > 0 else None,
                token_ids=list(token_ids[start * bs:(prev + 1) * bs]), block_size=bs))
            start = prev = i

    def _drop_hash(self, block: KVCacheBlock) -> BlockHash | None:
        """Take the block's hash off it; returns the hash if it left the map with it."""
        block_hash = block.block_hash
        if block_hash is None:
            return None
        block.block_hash = None
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
            return block_hash
        return None

    def check_invariants(self) -> None:
        """Assert the pool's structure (O(num_blocks); for tests and debugging)."""
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == self.free_block_queue.num_free_blocks
        for block in self.blocks:
            in_queue = block.block_id in free_ids
            assert block.ref_cnt >= 0, block
            assert in_queue != (block.ref_cnt > 0), f"{block}: free queue xor referenced"
            if not self.enable_caching and block.ref_cnt == 0:
                assert block.block_hash is None, f"{block}: free block hashed, caching off"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, block
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, block
            assert self.blocks[block.block_id] is block
