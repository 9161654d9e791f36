"""GET /tokenizer_info (vLLM's, --enable-tokenizer-info-endpoint): the tokenizer's
configuration, so a client such as lm-evaluation-harness can tokenize and render chats as the
server does (with /tokenize and /detokenize)."""

from __future__ import annotations

import math
import os
from typing import Any

# Loading details, not the tokenizer: file paths (vLLM drops vocab_file and merges_file; the
# others are paths too, here name_or_path is a cache folder), the object a test builds from.
_DROPPED_KEYS = frozenset({"name_or_path", "tokenizer_object", "token", "_commit_hash",
                           "revision", "is_local", "local_files_only", "trust_remote_code"})
_DROPPED_SUFFIXES = ("_file", "_dir", "_path")
_SKIP = object()  # a value with no JSON form: left out


def _jsonable(value: Any) -> Any:
    """As vLLM: an AddedToken becomes its text. Non-finite floats become null and other
    objects are left out, so the response always encodes."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    content = getattr(value, "content", None)
    if isinstance(content, str):
        return content
    if isinstance(value, dict):
        items = ((str(k), _jsonable(v)) for k, v in value.items())
        return {k: v for k, v in items if v is not _SKIP}
    if isinstance(value, list | tuple):
        return [v for v in map(_jsonable, value) if v is not _SKIP]
    return _SKIP


def _is_path(key: str, value: Any) -> bool:
    if key in _DROPPED_KEYS or key.endswith(_DROPPED_SUFFIXES):
        return True
    return isinstance(value, str) and "\n" not in value \
        and (os.path.isabs(value) or value.startswith("~"))


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's fields: the tokenizer's init config (tokenizer_config.json as loaded), the
    current special tokens, ``tokenizer_class`` (the Python class name) and ``chat_template``:
    ``chat_template`` is the one the server renders chats with (None: the model has none)."""
    config = dict(getattr(tokenizer, "init_kwargs", None) or {})
    config.pop("chat_template", None)  # replaced below by the one in use
    info = {k: v for k, v in _jsonable(config).items() if not _is_path(k, v)}
    # The tokens as they are now (they may differ from the loaded config).
    for name, token in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        info[name] = _jsonable(token)
    max_len = getattr(tokenizer, "model_max_length", None)
    if isinstance(max_len, int):
        info["model_max_length"] = max_len
    info["tokenizer_class"] = type(tokenizer).__name__
    if chat_template:
        info["chat_template"] = chat_template
    return info
