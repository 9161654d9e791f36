"""StructuredOutputsParams: what a request's output must match (vLLM's names and fields)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraint fields, in the order their kind is reported; exactly one is set.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, as a dict or a JSON string), ``regex``,
    ``choice`` (the output is one of these strings), ``grammar`` (EBNF in xgrammar/GBNF syntax,
    with a ``root`` rule) or ``json_object=True`` (any JSON object).

    ``disable_any_whitespace`` (JSON kinds only): no free whitespace between JSON tokens (the
    compact form, with ``", "`` and ``": "`` separators), which keeps small models from looping
    on whitespace. Invalid values raise ValueError naming the field; whether a schema, regex or
    grammar compiles is checked when the request is added to an engine.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_fields = [f for f in CONSTRAINT_FIELDS if _is_set(self, f)]
        if len(set_fields) != 1:
            got = ", ".join(set_fields) if set_fields else "none"
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, "
                             f"json_object must be set (got {got}).")
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
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool.")
        if self.disable_any_whitespace and self.kind not in ("json", "json_object"):
            raise ValueError("structured_outputs.disable_any_whitespace applies to json and "
                             "json_object only.")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINT_FIELDS."""
        return next(f for f in CONSTRAINT_FIELDS if _is_set(self, f))

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, compact whitespace): equal for specs that compile alike (a
        schema as a dict or as a JSON string)."""
        kind = self.kind
        if kind == "json":
            value = json.loads(self.json) if isinstance(self.json, str) else self.json
            # Key order kept: it is the order the properties are generated in.
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = self.regex if kind == "regex" else self.grammar  # type: ignore[assignment]
        return kind, text, self.disable_any_whitespace


def _is_set(params: StructuredOutputsParams, name: str) -> bool:
    value = getattr(params, name)
    if name == "json_object":
        return bool(value)
    return value is not None
