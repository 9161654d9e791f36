"""A request's structured-output fields -> one StructuredOutputsParams for the engine.

Four spellings ask for a constraint: OpenAI's ``response_format``, vLLM's ``structured_outputs``,
vLLM's older ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``, and (chat)
a ``tool_choice`` that forces a call. One request may ask for one constraint; two are a 400
naming both fields, never a silent pick.

Each spec is checked against the server's caps (limits.py: bytes, choices or enum values, JSON
depth) before anything parses or compiles it: what a spec costs to compile grows faster than
its size."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.limits import ServerLimits, json_depth_exceeds
from pagellm.entrypoints.openai.protocol_tools import ResponseFormat, StructuredOutputsRequest
from pagellm.entrypoints.openai.serving_errors import OpenAIError, bad_request
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.params import DEFAULT_MAX_WHITESPACE_CNT, WHITESPACE_KINDS

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    param: str  # the request field that asked for it, for error messages
    kind: str  # a StructuredOutputsParams field: json, regex, choice, grammar, json_object,
    # structural_tag
    value: Any
    # Yields to a constraint the request asks for itself (strict auto tool calls' tags).
    optional: bool = False


def request_constraints(req: Any) -> list[Constraint]:
    """The constraints that ``req``'s response_format, structured_outputs and guided_* fields
    ask for (several, when the client asked for several)."""
    found: list[Constraint] = []
    fmt: ResponseFormat | None = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(Constraint("response_format", "json_object", True))
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None  # the model's validator checks it
        found.append(Constraint("response_format", "json", fmt.json_schema.json_schema))
    elif fmt is not None and fmt.type == "structural_tag":
        found.append(Constraint("response_format", "structural_tag", fmt.structural_tag()))
    so: StructuredOutputsRequest | None = getattr(req, "structured_outputs", None)
    if so is not None:
        found.extend(Constraint(f"structured_outputs.{kind}", kind, value)
                     for kind, value in so.constraints().items())
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append(Constraint(name, kind, value))
    return found


def resolve_structured_outputs(req: Any, forced: Constraint | None = None,
                               limits: ServerLimits | None = None
                               ) -> tuple[StructuredOutputsParams | None, Constraint | None]:
    """The engine's params for ``req`` (plus ``forced``, a tool_choice's schema, whose tools
    plan_tools checked against the caps) and the constraint they come from; None, None when it
    asks for none."""
    constraints = request_constraints(req)
    limits = limits or ServerLimits()
    for c in constraints:
        check_spec_caps(c.kind, [c.value], c.param, limits)
    if forced is not None and not (forced.optional and constraints):
        constraints.append(forced)
    so: StructuredOutputsRequest | None = getattr(req, "structured_outputs", None)
    compact = so.disable_any_whitespace if so is not None else False
    # The request's own whitespace cap (null: unbounded) when it gives one, else the server's.
    explicit_cap = so is not None and "max_whitespace_cnt" in so.model_fields_set
    cap = so.max_whitespace_cnt if explicit_cap else limits.structured_outputs_max_whitespace_cnt
    params = structured_outputs_params(constraints, compact, cap, explicit_cap)
    return params, (constraints[0] if constraints else None)


@contextmanager
def constraint_errors(constraint: Constraint | None) -> Iterator[None]:
    """A spec the engine cannot compile (its ValueError "structured_outputs.<kind>: ...") is
    a 400 naming the request's field."""
    try:
        yield
    except ValueError as e:
        if constraint is None or not str(e).startswith("structured_outputs"):
            raise
        raise constraint_error(e, constraint) from None


def structured_outputs_params(constraints: list[Constraint], disable_any_whitespace: bool = False,
                              max_whitespace_cnt: int | None = DEFAULT_MAX_WHITESPACE_CNT,
                              explicit_cap: bool = False) -> StructuredOutputsParams | None:
    """The engine's params for at most one constraint; a 400 naming the fields otherwise, or
    naming the field whose value is invalid. ``max_whitespace_cnt`` caps a JSON constraint's
    free whitespace unless it is compact; ``explicit_cap``: the request gave it (so it must
    apply)."""
    if not constraints:
        for name, given in (("disable_any_whitespace", disable_any_whitespace),
                            ("max_whitespace_cnt", explicit_cap)):
            if given:
                raise bad_request(f"structured_outputs.{name} needs a JSON constraint.",
                                  "structured_outputs")
        return None
    if len(constraints) > 1:
        names = ", ".join(c.param for c in constraints)
        raise bad_request(f"Only one structured-output constraint per request; this one asks "
                          f"for {len(constraints)}: {names}.", constraints[1].param)
    (c,) = constraints
    fields: dict[str, Any] = {c.kind: c.value, "disable_any_whitespace": disable_any_whitespace}
    if explicit_cap:
        if c.kind not in WHITESPACE_KINDS:
            raise bad_request(f"structured_outputs.max_whitespace_cnt applies to JSON "
                              f"constraints, not to {c.param}.", "structured_outputs")
        if disable_any_whitespace:
            raise bad_request("structured_outputs.max_whitespace_cnt and "
                              "structured_outputs.disable_any_whitespace exclude each other: "
                              "the compact form has no free whitespace.", "structured_outputs")
    if c.kind in WHITESPACE_KINDS and not disable_any_whitespace:
        fields["max_whitespace_cnt"] = max_whitespace_cnt
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        if "max_whitespace_cnt" in str(e):  # the request's own field, whatever the constraint
            raise bad_request(str(e), "structured_outputs") from None
        raise constraint_error(e, c) from None


def check_spec_caps(kind: str, values: Sequence[Any], field: str, limits: ServerLimits) -> None:
    """A 400 naming ``field`` when a spec of ``kind`` (``values``: the spec, or the schemas a
    forced tool_choice is made of, counted together) is past a cap. Values of the wrong type are
    left for StructuredOutputsParams to refuse."""
    param = field.split(".")[0]
    num_bytes = num_choices = 0
    for value in values:
        num_bytes += _spec_bytes(value)
        if num_bytes > limits.max_structured_outputs_spec_bytes:
            raise bad_request(f"{field} is larger than "
                              f"{limits.max_structured_outputs_spec_bytes} bytes "
                              "(--max-structured-outputs-spec-bytes).", param)
        if kind == "choice" and isinstance(value, list):
            num_choices += len(value)
        elif kind in ("json", "structural_tag"):  # a tag holds schemas: counted alike
            depth, num_enum_values = _schema_shape(_parsed_schema(value, field, limits))
            if depth > limits.max_structured_outputs_depth:
                raise _too_deep(field, limits)
            num_choices += num_enum_values
    if num_choices > limits.max_structured_outputs_choices:
        what = "choices" if kind == "choice" else "enum values"
        raise bad_request(f"{field} has {num_choices} {what}, more than "
                          f"{limits.max_structured_outputs_choices} "
                          "(--max-structured-outputs-choices).", param)


def _spec_bytes(value: Any) -> int:
    """UTF-8 bytes of a spec: its text, a choice list's strings, a schema object's compact
    JSON."""
    if isinstance(value, str):
        return len(value.encode(errors="surrogatepass"))
    if isinstance(value, list):
        return sum(_spec_bytes(c) for c in value if isinstance(c, str))
    if isinstance(value, dict):
        return _spec_bytes(json.dumps(value, ensure_ascii=False, separators=(",", ":")))
    return 0


def _parsed_schema(value: Any, field: str, limits: ServerLimits) -> Any:
    """A schema sent as a string, parsed (None when it is not JSON: StructuredOutputsParams
    says why). Its depth is scanned first: the body's depth check does not see into strings,
    and json.loads recurses per level."""
    if not isinstance(value, str):
        return value
    if json_depth_exceeds(value.encode(errors="surrogatepass"),
                          limits.max_structured_outputs_depth):
        raise _too_deep(field, limits)
    try:
        return json.loads(value)
    except ValueError:
        return None


def _too_deep(field: str, limits: ServerLimits) -> OpenAIError:
    return bad_request(f"{field} nests deeper than {limits.max_structured_outputs_depth} levels "
                       "(--max-structured-outputs-depth).", field.split(".")[0])


def _schema_shape(schema: Any) -> tuple[int, int]:
    """(JSON nesting depth, values in all its ``enum`` lists) of a parsed schema; no recursion,
    so no depth is too deep for it."""
    depth = num_enum_values = 0
    stack = [(schema, 1)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            enum = value.get("enum")
            if isinstance(enum, list):
                num_enum_values += len(enum)
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return depth, num_enum_values


def constraint_error(error: ValueError, constraint: Constraint) -> OpenAIError:
    """The engine's "structured_outputs.<kind>: ..." message, naming the request's field."""
    message = str(error).replace(f"structured_outputs.{constraint.kind}", constraint.param)
    return bad_request(message, constraint.param.split(".")[0])
