"""Free whitespace in JSON grammars: bounded by default (max_whitespace_cnt), unbounded with
max_whitespace_cnt=None (the old behaviour), none with disable_any_whitespace; checked on the
compiled grammar with xgrammar's own GrammarMatcher, and through the server's request mapping
(response_format, json_object, forced tool calls, --structured-outputs-max-whitespace-cnt)."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.chat_tools import ChatToolOptions, plan_tools
from pagellm.entrypoints.openai.cli_serve import add_server_args, server_limits_from
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.serving_errors import OpenAIError
from pagellm.entrypoints.openai.structured_request import resolve_structured_outputs
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.compiler import GrammarCompiler
from pagellm.structured_output.params import DEFAULT_MAX_WHITESPACE_CNT

SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer"},
                         "b": {"type": "array", "items": {"type": "string"}}},
          "required": ["a", "b"]}
VALUE = {"a": 1, "b": ["x", "y"]}
CAP = DEFAULT_MAX_WHITESPACE_CNT


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(lambda: tiny_tokenizer, len(tiny_tokenizer),
                           [tiny_tokenizer.eos_token_id])


def completes(compiler: GrammarCompiler, spec: StructuredOutputsParams, text: str) -> bool:
    """xgrammar's matcher on the compiled grammar takes ``text`` and then the end (EOS)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile(spec))
    return (matcher.accept_string(text) and matcher.accept_token(compiler.stop_token_ids[0])
            and matcher.is_terminated())


def spaced(n: int) -> str:
    """VALUE with a run of ``n`` whitespace characters after the colon of "a"."""
    return '{"a":' + (" \n\t" * n)[:n] + '1,"b":["x","y"]}'


def test_default_cap_accepts_compact_and_lightly_spaced_json(compiler) -> None:
    spec = StructuredOutputsParams(json=SCHEMA)
    assert spec.max_whitespace_cnt == CAP
    assert completes(compiler, spec, json.dumps(VALUE, separators=(",", ":")))
    assert completes(compiler, spec, json.dumps(VALUE))  # ", " and ": "
    assert completes(compiler, spec, '{ "a" : 1 ,\n "b" : [ "x" , "y" ] }')
    assert completes(compiler, spec, json.dumps({"a": 1, "b": []}, indent=2))
    assert completes(compiler, spec, spaced(CAP))
    # Whitespace inside strings is content, not free whitespace: no cap.
    assert completes(compiler, spec, json.dumps({"a": 1, "b": [" " * 20]}))


def test_default_cap_rejects_a_longer_run(compiler) -> None:
    spec = StructuredOutputsParams(json=SCHEMA)
    assert not completes(compiler, spec, spaced(CAP + 1))
    assert not completes(compiler, spec, "{" + "\n" * 259)  # the loop seen on the default model
    # A run is per gap: the cap does not add up over the gaps.
    assert completes(compiler, spec, '{"a":' + " " * CAP + "1," + " " * CAP
                     + '"b":["x","y"]' + " " * CAP + "}")


def test_unbounded_restores_any_whitespace(compiler) -> None:
    spec = StructuredOutputsParams(json=SCHEMA, max_whitespace_cnt=None)
    assert completes(compiler, spec, spaced(CAP + 1))
    assert completes(compiler, spec, spaced(300))
    assert completes(compiler, spec, json.dumps(VALUE, indent=4))


def test_a_chosen_cap(compiler) -> None:
    spec = StructuredOutputsParams(json=SCHEMA, max_whitespace_cnt=8)
    assert completes(compiler, spec, spaced(8)) and not completes(compiler, spec, spaced(9))
    # Pretty-printed at indent 2 needs 1 + 2 x depth characters in a row: 5 here.
    pretty = json.dumps(VALUE, indent=2)
    assert completes(compiler, spec, pretty)
    assert not completes(compiler, StructuredOutputsParams(json=SCHEMA, max_whitespace_cnt=2),
                         pretty)


def test_json_object_is_capped_too(compiler) -> None:
    capped = StructuredOutputsParams(json_object=True)
    free = StructuredOutputsParams(json_object=True, max_whitespace_cnt=None)
    assert completes(compiler, capped, '{"k": [1, 2]}')
    assert not completes(compiler, capped, '{"k":' + " " * (CAP + 1) + "1}")
    assert completes(compiler, free, '{"k":' + " " * (CAP + 1) + "1}")


def test_compact_keeps_its_meaning(compiler) -> None:
    compact = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    assert completes(compiler, compact, '{"a": 1, "b": ["x", "y"]}')
    assert not completes(compiler, compact, '{"a":  1, "b": ["x", "y"]}')
    assert not completes(compiler, compact, '{ "a": 1, "b": ["x", "y"]}')


def test_whitespace_mode_is_part_of_the_cache_key(compiler) -> None:
    schema = {"type": "object", "properties": {"zz_ws_key": {"type": "integer"}}}
    specs = [StructuredOutputsParams(json=schema),
             StructuredOutputsParams(json=schema, max_whitespace_cnt=None),
             StructuredOutputsParams(json=schema, max_whitespace_cnt=8),
             StructuredOutputsParams(json=schema, disable_any_whitespace=True)]
    assert len({s.cache_key() for s in specs}) == 4
    assert len({id(compiler.compile(s)) for s in specs}) == 4
    again = StructuredOutputsParams(json=json.dumps(schema), max_whitespace_cnt=CAP)
    assert compiler.compile(again) is compiler.compile(specs[0])


@pytest.mark.parametrize(("fields", "message"), [
    ({"json": SCHEMA, "max_whitespace_cnt": 0}, "must be a positive integer or None"),
    ({"json": SCHEMA, "max_whitespace_cnt": True}, "must be a positive integer or None"),
    ({"json": SCHEMA, "max_whitespace_cnt": 2.5}, "must be a positive integer or None"),
    ({"regex": "a+", "max_whitespace_cnt": None},
     "applies to json, json_object and structural_tag only"),
    ({"json": SCHEMA, "max_whitespace_cnt": 8, "disable_any_whitespace": True},
     "exclude each other"),
])
def test_bad_values_name_the_field(fields, message) -> None:
    with pytest.raises(ValueError, match="structured_outputs.max_whitespace_cnt") as e:
        StructuredOutputsParams(**fields)
    assert message in str(e.value)


# --- the server's mapping -------------------------------------------------------------------

ASK = [{"role": "user", "content": "x"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **fields})


def resolve(req: ChatCompletionRequest, limits: ServerLimits | None = None
            ) -> StructuredOutputsParams:
    limits = limits or ServerLimits()
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ChatToolOptions(),
                      limits)
    params, _ = resolve_structured_outputs(req, plan.constraint, limits)
    assert params is not None
    return params


JSON_SCHEMA_FMT = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
REQUESTS = {
    "json_schema": {"response_format": JSON_SCHEMA_FMT},
    "json_object": {"response_format": {"type": "json_object"}},
    "tool_required": {"tools": [TOOL], "tool_choice": "required"},
    "tool_named": {"tools": [TOOL], "tool_choice": {"type": "function",
                                                    "function": {"name": "f"}}},
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_server_applies_its_flag_and_the_request_field(name) -> None:
    fields = REQUESTS[name]
    assert resolve(chat(**fields)).max_whitespace_cnt == CAP
    assert resolve(chat(**fields), ServerLimits(structured_outputs_max_whitespace_cnt=None)
                   ).max_whitespace_cnt is None
    # The request's own field wins over the flag, null meaning unbounded.
    assert resolve(chat(**fields, structured_outputs={"max_whitespace_cnt": None})
                   ).max_whitespace_cnt is None
    assert resolve(chat(**fields, structured_outputs={"max_whitespace_cnt": 9}),
                   ServerLimits(structured_outputs_max_whitespace_cnt=None)
                   ).max_whitespace_cnt == 9
    compact = resolve(chat(**fields, structured_outputs={"disable_any_whitespace": True}),
                      ServerLimits(structured_outputs_max_whitespace_cnt=7))
    assert compact.whitespace() == "compact"


def test_server_flag_parses_none_and_counts() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_limits_from(parser.parse_args([])).structured_outputs_max_whitespace_cnt == CAP
    for text, value in (("none", None), ("None", None), ("12", 12)):
        ns = parser.parse_args(["--structured-outputs-max-whitespace-cnt", text])
        assert server_limits_from(ns).structured_outputs_max_whitespace_cnt == value
    for text in ("0", "-3", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--structured-outputs-max-whitespace-cnt", text])


@pytest.mark.parametrize(("fields", "message"), [
    ({"structured_outputs": {"regex": "a", "max_whitespace_cnt": 4}},
     "applies to JSON constraints, not to structured_outputs.regex"),
    ({"response_format": JSON_SCHEMA_FMT,
      "structured_outputs": {"disable_any_whitespace": True, "max_whitespace_cnt": None}},
     "exclude each other"),
    ({"structured_outputs": {"max_whitespace_cnt": 4}}, "needs a JSON constraint"),
    ({"response_format": JSON_SCHEMA_FMT, "structured_outputs": {"max_whitespace_cnt": 0}},
     "must be a positive integer"),
])
def test_server_refuses_a_field_it_could_not_apply(fields, message) -> None:
    req = chat(**fields)
    with pytest.raises(OpenAIError) as e:
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          ChatToolOptions(), ServerLimits())
        resolve_structured_outputs(req, plan.constraint, ServerLimits())
    assert e.value.status == 400 and message in e.value.message
    assert e.value.param == "structured_outputs"


def test_server_refuses_a_non_integer_field() -> None:
    from pydantic import ValidationError

    for bad in (True, "4", 2.5):
        with pytest.raises(ValidationError, match="max_whitespace_cnt"):
            chat(response_format=JSON_SCHEMA_FMT, structured_outputs={"max_whitespace_cnt": bad})
