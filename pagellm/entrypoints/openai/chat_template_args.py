"""chat_template_kwargs and documents (vLLM's chat fields): data for the chat template.

They are variables the template reads (``enable_thinking``, ``thinking``, a RAG template's
``documents``), never template code: a request's own ``chat_template`` stays refused. Values
must be JSON data (what a request body holds; the offline LLM.chat is checked the same way),
keys must not collide with what the renderer passes itself, and both are capped in size.
"""

from __future__ import annotations

import json
from typing import Any

# What ChatRenderer / transformers' apply_chat_template pass to the template themselves, the
# tokenizer's special-token variables and the template globals: a kwarg must not replace them.
RESERVED_KEYS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "chat_template", "tokenize", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens", "raise_exception", "strftime_now",
})
_JSON_SCALARS = (str, int, float, bool, type(None))


class TemplateArgsError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _is_json_data(value: Any, depth: int = 0) -> bool:
    if depth > 64:
        return False
    if isinstance(value, _JSON_SCALARS):
        return True
    if isinstance(value, list | tuple):
        return all(_is_json_data(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_data(v, depth + 1)
                   for k, v in value.items())
    return False


def check_template_kwargs(kwargs: dict[str, Any] | None, max_bytes: int | None
                          ) -> dict[str, Any]:
    """The kwargs to render with ({} for None); TemplateArgsError naming
    chat_template_kwargs for a reserved key, a value that is not JSON data, or more than
    ``max_bytes`` of JSON (None: no cap, offline)."""
    if not kwargs:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TemplateArgsError("chat_template_kwargs must be an object with string keys.",
                                "chat_template_kwargs")
    clash = sorted(k for k in kwargs if k in RESERVED_KEYS)
    if clash:
        raise TemplateArgsError(
            f"chat_template_kwargs may not set {clash[0]!r}: the renderer sets it (use the "
            "request's own field where there is one).", "chat_template_kwargs")
    if not _is_json_data(kwargs):
        raise TemplateArgsError("chat_template_kwargs values must be JSON data (strings, "
                                "numbers, booleans, null, lists and objects).",
                                "chat_template_kwargs")
    if max_bytes is not None:
        size = len(json.dumps(kwargs, ensure_ascii=False).encode())
        if size > max_bytes:
            raise TemplateArgsError(f"chat_template_kwargs is {size} bytes of JSON, more than "
                                    f"{max_bytes} (--max-chat-template-kwargs-bytes).",
                                    "chat_template_kwargs")
    return dict(kwargs)


def check_documents(documents: list[dict[str, Any]] | None, max_documents: int | None
                    ) -> list[dict[str, Any]] | None:
    """The documents to render with (None when there are none); TemplateArgsError naming
    documents for more than ``max_documents`` or a document that is not a JSON object."""
    if not documents:
        return None
    if max_documents is not None and len(documents) > max_documents:
        raise TemplateArgsError(f"documents has {len(documents)} documents, more than "
                                f"{max_documents} (--max-documents).", "documents")
    if not all(isinstance(d, dict) and _is_json_data(d) for d in documents):
        raise TemplateArgsError("Each document must be a JSON object (e.g. {\"title\": ..., "
                                "\"text\": ...}).", "documents")
    return list(documents)
