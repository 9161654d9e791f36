"""StructuredOutputsParams: what a request's output must match (vLLM's names and fields)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraint fields, in the order their kind is reported; exactly one is set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
JSON_KINDS = ("json", "json_object")  # the kinds compiled from a JSON schema
# The kinds with free whitespace (options below): a structural tag's JSON-schema parts have it.
WHITESPACE_KINDS = (*JSON_KINDS, "structural_tag")
# Whitespace characters allowed in a row between two JSON tokens. Unbounded (xgrammar's and
# vLLM's default), a small model can emit whitespace until max_tokens and never close the
# value; 4 still allows a newline plus a shallow indent. None: unbounded.
DEFAULT_MAX_WHITESPACE_CNT = 4


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, as a dict or a JSON string), ``regex``,
    ``choice`` (the output is one of these strings), ``grammar`` (EBNF in xgrammar/GBNF syntax,
    with a ``root`` rule), ``json_object=True`` (any JSON object) or ``structural_tag`` (an
    xgrammar structural tag, as a dict or a JSON string: vLLM's ``{"type": "structural_tag",
    "format": {...}}`` or its legacy ``{"structures": [...], "triggers": [...]}``).

    ``disable_any_whitespace`` (JSON kinds and structural tags only): no free whitespace
    between JSON tokens (the compact form, with ``", "`` and ``": "`` separators). Otherwise
    ``max_whitespace_cnt`` (the same kinds; in a structural tag, for each JSON part that sets
    none itself) bounds each run of free whitespace (None: unbounded, xgrammar's and
    vLLM's behaviour, under which small models can loop on whitespace until max_tokens).
    Invalid values raise ValueError naming the field; whether a schema, regex or grammar
    compiles is checked when the request is added to an engine.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    max_whitespace_cnt: int | None = DEFAULT_MAX_WHITESPACE_CNT

    def __post_init__(self) -> None:
        set_fields = [f for f in CONSTRAINT_FIELDS if _is_set(self, f)]
        if len(set_fields) != 1:
            got = ", ".join(set_fields) if set_fields else "none"
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag must be set (got {got}).")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
                if not isinstance(parsed, dict | bool):
                    raise ValueError("structured_outputs.json: a JSON schema must be an object.")
            elif not isinstance(self.json, dict):
                raise ValueError("structured_outputs.json must be a JSON schema (a dict or a "
                                 f"JSON string), got {type(self.json).__name__}.")
            else:
                try:
                    json.dumps(self.json)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"structured_outputs.json: not JSON-serializable: {e}"
                                     ) from None
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string.")
        if self.grammar is not None and (not isinstance(self.grammar, str)
                                         or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty EBNF string.")
        if self.choice is not None:
            if (isinstance(self.choice, str | bytes) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings.")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool.")
        if self.structural_tag is not None:
            _check_structural_tag(self.structural_tag)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool.")
        if self.disable_any_whitespace and self.kind not in WHITESPACE_KINDS:
            raise ValueError("structured_outputs.disable_any_whitespace applies to json, "
                             "json_object and structural_tag only.")
        self._check_max_whitespace_cnt()

    def _check_max_whitespace_cnt(self) -> None:
        cnt = self.max_whitespace_cnt
        if cnt is not None and (isinstance(cnt, bool) or not isinstance(cnt, int) or cnt < 1):
            raise ValueError("structured_outputs.max_whitespace_cnt must be a positive integer "
                             f"or None (unbounded), got {cnt!r}.")
        if cnt == DEFAULT_MAX_WHITESPACE_CNT:
            return
        if self.kind not in WHITESPACE_KINDS:
            raise ValueError("structured_outputs.max_whitespace_cnt applies to json, "
                             "json_object and structural_tag only.")
        if self.disable_any_whitespace:
            raise ValueError("structured_outputs.max_whitespace_cnt and disable_any_whitespace "
                             "exclude each other: the compact form has no free whitespace.")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINT_FIELDS."""
        return next(f for f in CONSTRAINT_FIELDS if _is_set(self, f))

    def whitespace(self) -> str | int | None:
        """How the grammar treats free whitespace: "compact" (none), a cap on each run, or None
        (unbounded); None too for the kinds that have no free whitespace."""
        if self.kind not in WHITESPACE_KINDS:
            return None
        return "compact" if self.disable_any_whitespace else self.max_whitespace_cnt

    def cache_key(self) -> tuple[str, str, str | int | None]:
        """(kind, canonical text, whitespace()): equal for specs that compile alike (a schema as
        a dict or as a JSON string)."""
        kind = self.kind
        if kind in ("json", "structural_tag"):
            spec = getattr(self, kind)
            value = json.loads(spec) if isinstance(spec, str) else spec
            # Key order kept: it is the order the properties are generated in.
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = self.regex if kind == "regex" else self.grammar  # type: ignore[assignment]
        return kind, text, self.whitespace()


def _is_set(params: StructuredOutputsParams, name: str) -> bool:
    value = getattr(params, name)
    if name == "json_object":
        return bool(value)
    return value is not None


def _check_structural_tag(spec: Any) -> None:
    """A JSON object (its formats are checked when it compiles, by xgrammar)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.structural_tag: not valid JSON: {e}") from None
    elif isinstance(spec, dict):
        try:
            json.dumps(spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.structural_tag: not JSON-serializable: {e}"
                             ) from None
    if not isinstance(spec, dict):
        raise ValueError("structured_outputs.structural_tag must be a JSON object (a dict or a "
                         "JSON string).")
