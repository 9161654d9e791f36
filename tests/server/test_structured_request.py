"""Request fields -> one structured-output constraint: the spellings (response_format,
structured_outputs, guided_*), and a 400 naming the fields for two constraints or a bad one."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.serving_errors import OpenAIError
from pagellm.entrypoints.openai.structured_request import (
    Constraint,
    constraint_errors,
    resolve_structured_outputs,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


@pytest.mark.parametrize(("fields", "kind", "value"), [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}},
     "json", SCHEMA),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ({"guided_json": SCHEMA}, "json", SCHEMA),
    ({"guided_regex": "a|b"}, "regex", "a|b"),
    ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
])
def test_each_spelling(fields, kind, value):
    params, constraint = resolve_structured_outputs(completion(**fields))
    assert params.kind == kind and getattr(params, kind) == value
    assert constraint.kind == kind


def test_no_constraint():
    assert resolve_structured_outputs(completion()) == (None, None)
    assert resolve_structured_outputs(
        completion(response_format={"type": "text"})) == (None, None)


def test_compact_whitespace_passes_through():
    params, _ = resolve_structured_outputs(completion(
        structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}))
    assert params.disable_any_whitespace


@pytest.mark.parametrize(("fields", "named"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "response_format, guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs.regex, structured_outputs.choice"),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_json, guided_choice"),
])
def test_two_constraints_are_a_400_naming_both(fields, named):
    with pytest.raises(OpenAIError) as e:
        resolve_structured_outputs(completion(**fields))
    assert e.value.status == 400 and named in e.value.message


def test_a_tool_choice_with_a_response_format_is_two_constraints():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_object"}})
    with pytest.raises(OpenAIError) as e:
        resolve_structured_outputs(req, Constraint("tool_choice", "json", SCHEMA))
    assert "response_format, tool_choice" in e.value.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
])
def test_an_invalid_value_is_a_400_naming_its_field(fields, param):
    with pytest.raises(OpenAIError) as e:
        resolve_structured_outputs(completion(**fields))
    assert e.value.param == param and param in e.value.message


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema"}},  # no schema
    {"response_format": {"type": "xml"}},
    {"structured_outputs": {"whitespace_pattern": "x"}},  # a vLLM key pagellm lacks: refused
    {"guided_choice": "yes"},
])
def test_malformed_fields_fail_validation(fields):
    with pytest.raises(ValidationError):
        completion(**fields)


def test_a_compile_error_names_the_request_field():
    with pytest.raises(OpenAIError) as e, \
            constraint_errors(Constraint("guided_regex", "regex", "(")):
        raise ValueError("structured_outputs.regex: invalid regex: missing )")
    assert e.value.param == "guided_regex"
    assert e.value.message == "guided_regex: invalid regex: missing )"
    with pytest.raises(ValueError, match="other"), constraint_errors(None):
        raise ValueError("other")
