"""Values a model wrote as text or as Python literals, made JSON values: Qwen3-Coder's
parameter values (typed by the tool's JSON schema, as vLLM's qwen3_coder parser types them)
and pythonic calls' arguments (Python literals, read with ast, never evaluated)."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float")
_BOOLEAN_TYPES = ("boolean", "bool", "binary")
_CONTAINER_PREFIXES = ("object", "array", "arr", "dict", "list")


def as_json_value(value: Any) -> Any:
    """``value`` with tuples as lists; ValueError when JSON cannot hold it (a set, bytes, a
    complex or non-finite number, a key that is not a string)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("not a finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [as_json_value(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("a key that is not a string")
        return {k: as_json_value(v) for k, v in value.items()}
    raise ValueError(f"a {type(value).__name__}")


def literal_value(node: ast.expr | str) -> Any:
    """A Python literal (``True``, ``[1, 'a']``, ``{'k': None}``, ...) as a JSON value;
    ValueError when it is not one."""
    try:
        return as_json_value(ast.literal_eval(node))
    except (SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(str(e)) from None


def _schema_type(schema: Any) -> str:
    """The lower-cased JSON-schema type of a property ("string" when it names none)."""
    if not isinstance(schema, dict) or "type" not in schema:
        return "string"
    kind = schema["type"]
    if isinstance(kind, list):  # ["integer", "null"]: the type that is not null
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def typed_value(raw: str, schema: Any) -> Any:
    """Qwen3-Coder's parameter text as the value its property's schema types it as; text that
    is not of that type stays a string (vLLM's rules)."""
    if raw.lower() == "null":
        return None
    kind = _schema_type(schema)
    if kind in _STRING_TYPES:
        return raw
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(raw)
        except ValueError:
            return raw
    if kind.startswith(_NUMBER_PREFIXES):
        try:
            number = float(raw)
        except ValueError:
            return raw
        if not math.isfinite(number):
            return raw
        return int(number) if number.is_integer() else number
    if kind in _BOOLEAN_TYPES:
        lowered = raw.strip().lower()
        return lowered == "true" if lowered in ("true", "false") else raw
    if kind.startswith(_CONTAINER_PREFIXES):
        try:
            return as_json_value(json.loads(raw))
        except ValueError:
            pass
    try:
        return literal_value(raw)
    except ValueError:
        return raw
