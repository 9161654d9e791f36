"""A block's hash carries --kv-cache-dtype (all but auto), so a block written in one KV dtype is
never found by a request of an engine with another: the same tokens hash apart, auto keeps the
hashes it always had, and fp8 / fp8_e4m3 (the same bytes) hash alike."""

from __future__ import annotations

from pagellm.core.block_hash import extend_block_hashes, get_hash_fn, request_extra_keys
from pagellm.kv_cache_dtype import parse_kv_cache_dtype


def _hashes(kv: str, salt: str | None = None) -> list[bytes]:
    keys = request_extra_keys(salt, None, True, parse_kv_cache_dtype(kv).hash_key())
    out: list = []
    extend_block_hashes(get_hash_fn("sha256"), 4, list(range(12)), out, keys)
    return out


def test_kv_dtype_separates_hashes() -> None:
    auto = _hashes("auto")
    assert auto == _hashes("auto") and len(auto) == 3
    assert parse_kv_cache_dtype("auto").hash_key() is None  # unchanged hashes for auto
    kinds = ["bfloat16", "fp8", "fp8_e5m2", "int8_per_token_head"]
    all_hashes = [auto] + [_hashes(kv) for kv in kinds]
    firsts = {h[0] for h in all_hashes}
    assert len(firsts) == len(all_hashes)  # every KV dtype hashes apart, from the first block
    assert _hashes("fp8") == _hashes("fp8_e4m3")
    assert _hashes("fp8", salt="a") != _hashes("fp8")
