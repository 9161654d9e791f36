"""A request's structured-output fields -> one StructuredOutputsParams for the engine.

Four spellings ask for a constraint: OpenAI's ``response_format``, vLLM's ``structured_outputs``,
vLLM's older ``guided_json``/``guided_regex``/``guided_choice``/``guided_grammar``, and (chat)
a ``tool_choice`` that forces a call. One request may ask for one constraint; two are a 400
naming both fields, never a silent pick."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.protocol_tools import ResponseFormat, StructuredOutputsRequest
from pagellm.entrypoints.openai.serving_errors import OpenAIError, bad_request
from pagellm.sampling_params import StructuredOutputsParams

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    param: str  # the request field that asked for it, for error messages
    kind: str  # a StructuredOutputsParams field: json, regex, choice, grammar, json_object
    value: Any


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
    so: StructuredOutputsRequest | None = getattr(req, "structured_outputs", None)
    if so is not None:
        found.extend(Constraint(f"structured_outputs.{kind}", kind, value)
                     for kind, value in so.constraints().items())
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append(Constraint(name, kind, value))
    return found


def resolve_structured_outputs(req: Any, forced: Constraint | None = None
                               ) -> tuple[StructuredOutputsParams | None, Constraint | None]:
    """The engine's params for ``req`` (plus ``forced``, a tool_choice's schema) and the
    constraint they come from; None, None when it asks for none."""
    constraints = request_constraints(req)
    if forced is not None:
        constraints.append(forced)
    so: StructuredOutputsRequest | None = getattr(req, "structured_outputs", None)
    compact = so.disable_any_whitespace if so is not None else False
    params = structured_outputs_params(constraints, compact)
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


def structured_outputs_params(constraints: list[Constraint], disable_any_whitespace: bool = False
                              ) -> StructuredOutputsParams | None:
    """The engine's params for at most one constraint; a 400 naming the fields otherwise, or
    naming the field whose value is invalid."""
    if not constraints:
        if disable_any_whitespace:
            raise bad_request("structured_outputs.disable_any_whitespace needs a JSON "
                              "constraint.", "structured_outputs")
        return None
    if len(constraints) > 1:
        names = ", ".join(c.param for c in constraints)
        raise bad_request(f"Only one structured-output constraint per request; this one asks "
                          f"for {len(constraints)}: {names}.", constraints[1].param)
    (c,) = constraints
    try:
        return StructuredOutputsParams(**{c.kind: c.value},
                                       disable_any_whitespace=disable_any_whitespace)
    except ValueError as e:
        raise constraint_error(e, c) from None


def constraint_error(error: ValueError, constraint: Constraint) -> OpenAIError:
    """The engine's "structured_outputs.<kind>: ..." message, naming the request's field."""
    message = str(error).replace(f"structured_outputs.{constraint.kind}", constraint.param)
    return bad_request(message, constraint.param.split(".")[0])
