"""Block hashes for prefix caching: a chain over full blocks of token ids (pure Python).

A block's hash covers its parent's hash (or ``NONE_HASH`` for the first block), its token ids and
its extra keys (cache salt, n>1 group), so two blocks hash alike only when every token before and
in them, and the tenant, agree. The encoding is canonical (little-endian uint32 tokens with length
prefixes, utf-8 keys with length prefixes) and the hash is a stable cryptographic digest, never
Python's per-process salted ``hash``.
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Callable, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
HashFn = Callable[[bytes], bytes]
# Extra keys are tagged strings ("salt=...", "group=..."); the tag ends at the first "=".
ExtraKeys = tuple[str, ...]

HASH_ALGOS = ("sha256", "blake2b")

# The root every chain starts from: a fixed constant, so hashes agree across processes and runs.
NONE_HASH = BlockHash(hashlib.sha256(b"pagellm.block_hash.NONE_HASH.v1").digest())

_U32 = struct.Struct("<I")
_BIG_ENDIAN = sys.byteorder == "big"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _blake2b(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


def get_hash_fn(algo: str) -> HashFn:
    """The digest function for ``prefix_caching_hash_algo``.

    ``"sha256"`` (default) is the reference. ``"blake2b"`` (32-byte digest) is an alternative
    from the standard library, equally collision-resistant: it is faster in software on CPUs
    without SHA extensions, and no faster (slower on long inputs) on CPUs with them. For
    16-token blocks both cost little next to the Python call around them, so the choice matters
    little. Hashes of the two algorithms never match each other.
    """
    if algo == "sha256":
        return _sha256
    if algo == "blake2b":
        return _blake2b
    raise ValueError(
        f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}."
    )


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    arr = array.array("I", token_ids)  # raises OverflowError on a negative or > 2**32 id
    if _BIG_ENDIAN:
        arr.byteswap()
    return _U32.pack(len(arr)) + arr.tobytes()


def _encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    parts = [_U32.pack(len(extra_keys))]
    for key in extra_keys:
        raw = key.encode("utf-8")
        parts.append(_U32.pack(len(raw)))
        parts.append(raw)
    return b"".join(parts)


def hash_block_tokens(
    hash_fn: HashFn,
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = (),
) -> BlockHash:
    """Hash of one full block, chained on ``parent_hash`` (``None`` = first block)."""
    parent = NONE_HASH if parent_hash is None else parent_hash
    data = parent + _encode_tokens(token_ids) + _encode_extra_keys(extra_keys)
    return BlockHash(hash_fn(data))


def extend_block_hashes(
    hash_fn: HashFn,
    block_size: int,
    token_ids: Sequence[int],
    block_hashes: list[BlockHash],
    first_block_extra_keys: ExtraKeys = (),
) -> None:
    """Append to ``block_hashes`` the hashes of every full block of ``token_ids`` not yet hashed.

    Incremental: a request's list grows as tokens are added; earlier hashes are never recomputed.
    Only the first block carries the extra keys; the chain carries them to every later block.
    """
    num_full_blocks = len(token_ids) // block_size
    start = len(block_hashes)
    parent = block_hashes[-1] if block_hashes else None
    for i in range(start, num_full_blocks):
        extra = first_block_extra_keys if i == 0 else ()
        parent = hash_block_tokens(
            hash_fn, parent, token_ids[i * block_size : (i + 1) * block_size], extra
        )
        block_hashes.append(parent)


def request_extra_keys(
    cache_salt: str | None, group_id: str | None, enable_caching: bool,
    kv_dtype_key: str | None = None,
) -> ExtraKeys | None:
    """Extra keys of a request's first block, or ``None`` when the request is not hashed at all.

    With prefix caching on, every request is hashed and a non-empty salt isolates its tenant
    (``None`` and ``""`` both mean unsalted). With it off, only the n samples of one prompt share
    blocks, so only requests with a ``group_id`` are hashed, and the group id keeps the chain
    private to the siblings. ``kv_dtype_key`` (KVCacheDtype.hash_key: None for
    --kv-cache-dtype auto) keeps blocks of one KV dtype from ever matching another's, in this
    engine or in a router comparing several engines' KV events.
    """
    keys: list[str] = [kv_dtype_key] if kv_dtype_key else []
    if cache_salt:
        keys.append("salt=" + cache_salt)
    if not enable_caching:
        if group_id is None:
            return None
        keys.append("group=" + group_id)
    return tuple(keys)
