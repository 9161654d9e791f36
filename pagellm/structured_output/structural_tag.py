"""Structural tags (xgrammar's): a spec in vLLM's shapes -> the JSON text xgrammar compiles.

Two shapes are taken, as vLLM takes them: ``{"type": "structural_tag", "format": {...}}``
(xgrammar's format tree: tag, triggered_tags, tags_with_separator, sequence, json_schema, ...)
and the legacy ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`` (free
text until a trigger, then one of the structures), which becomes the equivalent
``triggered_tags`` format. The request's whitespace setting applies to every JSON part that
sets none itself (``max_whitespace_cnt``); the compact form turns those parts into the compact
JSON grammar, which xgrammar's json_schema format has no option for.
"""

from __future__ import annotations

import copy
import json
from typing import Any

# A legacy structure without a schema: any JSON value.
_ANY_JSON: bool = True


def structural_tag_json(spec: dict[str, Any], whitespace: str | int | None) -> str:
    """The JSON text to give xgrammar's compile_structural_tag; ValueError for a legacy spec of
    the wrong shape (the new shape is xgrammar's to check)."""
    tag = from_legacy(spec) if "structures" in spec or "triggers" in spec else copy.deepcopy(spec)
    _apply_whitespace(tag, whitespace)
    return json.dumps(tag, ensure_ascii=False)


def from_legacy(spec: dict[str, Any]) -> dict[str, Any]:
    """``{"structures": [...], "triggers": [...]}`` -> ``{"type": "structural_tag", "format":
    {"type": "triggered_tags", ...}}``."""
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list of {begin, schema, end}.")
    if (not isinstance(triggers, list) or not triggers
            or not all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("triggers must be a non-empty list of non-empty strings.")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) \
                or not isinstance(s.get("end"), str):
            raise ValueError(f"structures[{i}] needs string begin and end.")
        schema = s.get("schema")
        if schema is None:
            schema = _ANY_JSON
        elif not isinstance(schema, dict | bool):
            raise ValueError(f"structures[{i}].schema must be a JSON schema object.")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": copy.deepcopy(schema)}})
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}}


def _apply_whitespace(tag: dict[str, Any], whitespace: str | int | None) -> None:
    """Sets the whitespace of the JSON-style json_schema formats in ``tag`` that leave it
    unset, in place (no recursion: the caps bound the depth, not the stack)."""
    if whitespace is None:
        return
    stack: list[Any] = [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") == "json_schema":
            if node.get("style", "json") == "json" and "max_whitespace_cnt" not in node:
                _set_whitespace(node, whitespace)
            continue  # the schema itself holds no formats
        stack.extend(v for v in node.values() if isinstance(v, dict | list))


def _set_whitespace(node: dict[str, Any], whitespace: str | int) -> None:
    if whitespace != "compact":
        node["max_whitespace_cnt"] = whitespace
        return
    import xgrammar as xgr

    schema = node.get("json_schema")
    if not isinstance(schema, dict | bool):
        return  # not a schema: xgrammar names the error when the tag compiles
    options = sorted(set(node) - {"type", "json_schema", "style"})
    if options:  # the grammar form would drop them
        raise ValueError("disable_any_whitespace cannot apply to a json_schema format with "
                         f"{', '.join(options)}.")
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    node.clear()
    node.update({"type": "grammar", "grammar": str(grammar)})
