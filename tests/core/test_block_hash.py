from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

import pagellm
from pagellm.core.block_hash import (
    NONE_HASH,
    BlockHash,
    extend_block_hashes,
    get_hash_fn,
    hash_block_tokens,
    request_extra_keys,
)

SHA = get_hash_fn("sha256")


def reference_hash(parent: bytes, tokens: list[int], extra: tuple[str, ...] = ()) -> bytes:
    """The documented encoding, written out independently with struct."""
    data = parent + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens)
    data += struct.pack("<I", len(extra))
    for key in extra:
        raw = key.encode()
        data += struct.pack("<I", len(raw)) + raw
    return hashlib.sha256(data).digest()


def test_matches_reference_encoding() -> None:
    h0 = hash_block_tokens(SHA, None, [1, 2, 3, 4], ("salt=é",))
    assert h0 == reference_hash(NONE_HASH, [1, 2, 3, 4], ("salt=é",))
    h1 = hash_block_tokens(SHA, h0, [5, 6, 7, 2**32 - 1])
    assert h1 == reference_hash(h0, [5, 6, 7, 2**32 - 1])
    assert len(h1) == 32


def test_stable_across_processes() -> None:
    code = (
        "from pagellm.core.block_hash import get_hash_fn, hash_block_tokens as h;"
        "print(h(get_hash_fn('sha256'), None, [1, 2, 3], ('salt=a',)).hex())"
    )
    # this process's str hash seed is random; the child's is fixed: Python's hash() would differ
    root = os.path.dirname(os.path.dirname(pagellm.__file__))
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=root)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert res.stdout.strip() == hash_block_tokens(SHA, None, [1, 2, 3], ("salt=a",)).hex()


def test_chain_depends_on_every_earlier_token() -> None:
    a: list[BlockHash] = []
    b: list[BlockHash] = []
    extend_block_hashes(SHA, 4, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], a)
    extend_block_hashes(SHA, 4, [1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11, 12], b)
    assert len(a) == len(b) == 3
    assert all(x != y for x, y in zip(a, b, strict=True))
    # the same block contents under different parents hash differently
    assert hash_block_tokens(SHA, a[0], [5, 6, 7, 8]) == a[1]
    assert hash_block_tokens(SHA, b[0], [5, 6, 7, 8]) == b[1] != a[1]


def test_incremental_extension_equals_full_and_skips_partial_blocks() -> None:
    tokens = list(range(100, 123))  # 5 full blocks of 4 + 3 tokens
    full: list[BlockHash] = []
    extend_block_hashes(SHA, 4, tokens, full, ("salt=x",))
    assert len(full) == 5
    inc: list[BlockHash] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(SHA, 4, tokens[:n], inc, ("salt=x",))
        assert len(inc) == n // 4
    assert inc == full
    # only the first block carries the extra keys
    assert full[0] == hash_block_tokens(SHA, None, tokens[:4], ("salt=x",))
    assert full[1] == hash_block_tokens(SHA, full[0], tokens[4:8])


def test_extra_keys_for_salts_and_groups() -> None:
    assert request_extra_keys(None, None, True) == ()
    assert request_extra_keys("", None, True) == ()  # "" means unsalted
    assert request_extra_keys("t1", "g", True) == ("salt=t1",)  # groups share via the cache
    assert request_extra_keys(None, None, False) is None  # caching off: not hashed
    assert request_extra_keys("t1", None, False) is None
    assert request_extra_keys(None, "g", False) == ("group=g",)
    assert request_extra_keys("t1", "g", False) == ("salt=t1", "group=g")
    toks = [1, 2, 3, 4]
    unsalted = hash_block_tokens(SHA, None, toks, ())
    salted = hash_block_tokens(SHA, None, toks, ("salt=t1",))
    other = hash_block_tokens(SHA, None, toks, ("salt=t2",))
    group = hash_block_tokens(SHA, None, toks, ("group=t1",))
    assert len({unsalted, salted, other, group}) == 4


def test_hash_algos() -> None:
    blake = get_hash_fn("blake2b")
    toks = [1, 2, 3, 4]
    hb = hash_block_tokens(blake, None, toks)
    assert len(hb) == 32 and hb != hash_block_tokens(SHA, None, toks)
    assert hb == hashlib.blake2b(NONE_HASH + struct.pack("<5I", 4, *toks) + struct.pack("<I", 0),
                                 digest_size=32).digest()
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        get_hash_fn("md5")
