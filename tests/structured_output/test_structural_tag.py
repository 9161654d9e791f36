"""Structural tags: the ``structural_tag`` constraint (vLLM's new ``format`` shape and its legacy
``structures``/``triggers`` shape) and tool calls constrained in the parser's own format.
Checked on the compiled grammar with xgrammar's own GrammarMatcher, the calls read back with the
real tool parser and validated with jsonschema, and the server's request mapping (400s, caps)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from pagellm.entrypoints.openai.chat_tools import ChatToolOptions, plan_tools
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.entrypoints.openai.serving_errors import OpenAIError
from pagellm.entrypoints.openai.structured_request import resolve_structured_outputs
from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.compiler import GrammarCompiler

ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
         {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
NEW = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<f="],
    "tags": [{"type": "tag", "begin": "<f=time>", "end": "</f>",
              "content": {"type": "json_schema", "json_schema": ZONE}}]}}
LEGACY = {"structures": [{"begin": "<f=time>", "schema": ZONE, "end": "</f>"}],
          "triggers": ["<f="]}
HERMES = ChatToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
LLAMA = ChatToolOptions(enable_auto_tool_choice=True, tool_call_parser="llama3_json")
ASK = [{"role": "user", "content": "x"}]


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


def hermes_call(name: str, arguments: dict) -> str:
    return (f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '
            f'{json.dumps(arguments)}}}\n</tool_call>')


# --- the structural_tag constraint ------------------------------------------------------------

@pytest.mark.parametrize("spec", [NEW, LEGACY, json.dumps(NEW), json.dumps(LEGACY)])
def test_structural_tag_text_then_a_tag_whose_content_matches(compiler, spec) -> None:
    params = StructuredOutputsParams(structural_tag=spec)
    assert params.kind == "structural_tag"
    assert completes(compiler, params, 'free text <f=time>{"zone": "UTC"}</f> and after')
    assert completes(compiler, params, "only text")
    assert not completes(compiler, params, 'x <f=time>{"zone": "PST"}</f>')  # not the schema
    assert not completes(compiler, params, 'x <f=time>{"zone": "UTC"}')  # the tag never ends
    assert not completes(compiler, params, 'x <f=date>{"zone": "UTC"}</f>')  # no such tag


def test_dict_and_text_share_a_cache_entry(compiler) -> None:
    a = StructuredOutputsParams(structural_tag=NEW)
    b = StructuredOutputsParams(structural_tag=json.dumps(NEW, indent=2))
    assert a.cache_key() == b.cache_key()
    assert compiler.compile(a) is compiler.compile(b)
    assert StructuredOutputsParams(structural_tag=NEW, max_whitespace_cnt=None).cache_key() \
        != a.cache_key()


def test_whitespace_applies_to_the_json_parts(compiler) -> None:
    spaced = '<f=time>{"zone":' + " " * 6 + '"UTC"}</f>'
    assert not completes(compiler, StructuredOutputsParams(structural_tag=NEW), spaced)
    assert completes(compiler, StructuredOutputsParams(structural_tag=NEW,
                                                       max_whitespace_cnt=None), spaced)
    compact = StructuredOutputsParams(structural_tag=NEW, disable_any_whitespace=True)
    assert completes(compiler, compact, '<f=time>{"zone": "UTC"}</f>')
    assert not completes(compiler, compact, '<f=time>{ "zone": "UTC"}</f>')
    # A part that sets its own cap keeps it.
    own = json.loads(json.dumps(NEW))
    own["format"]["tags"][0]["content"]["max_whitespace_cnt"] = 8
    assert completes(compiler, StructuredOutputsParams(structural_tag=own), spaced)


@pytest.mark.parametrize(("spec", "needle"), [
    ({"type": "structural_tag", "format": {"type": "nope"}}, "Format type not recognized"),
    ({"type": "structural_tag"}, "must have a format field"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<x>"],
      "tags": [{"type": "tag", "begin": "<y>", "end": "</y>",
                "content": {"type": "const_string", "value": "a"}}]}},
     "does not match any trigger"),
    ({"structures": [{"begin": "<a>", "end": "</a>", "schema": "x"}], "triggers": ["<a"]},
     "structures[0].schema must be a JSON schema object"),
    ({"structures": [], "triggers": ["<a"]}, "structures must be a non-empty list"),
])
def test_bad_specs_fail_to_compile_naming_the_field(compiler, spec, needle) -> None:
    with pytest.raises(ValueError) as e:
        compiler.compile(StructuredOutputsParams(structural_tag=spec))
    message = str(e.value)
    assert message.startswith("structured_outputs.structural_tag: invalid structural tag: ")
    assert needle in message and "Check failed" not in message


@pytest.mark.parametrize("spec", ["not json", "[1, 2]", 3])
def test_structural_tag_must_be_a_json_object(spec) -> None:
    with pytest.raises(ValueError, match="structured_outputs.structural_tag"):
        StructuredOutputsParams(structural_tag=spec)


# --- the server's mapping of response_format / structured_outputs ------------------------------

def resolve(req, limits: ServerLimits | None = None) -> StructuredOutputsParams | None:
    params, _ = resolve_structured_outputs(req, None, limits or ServerLimits())
    return params


@pytest.mark.parametrize("request_type", [ChatCompletionRequest, CompletionRequest])
def test_response_format_structural_tag_both_shapes(compiler, request_type) -> None:
    base = {"messages": ASK} if request_type is ChatCompletionRequest else {"prompt": "x"}
    for fmt in ({"type": "structural_tag", "format": NEW["format"]},
                {"type": "structural_tag", **LEGACY}):
        params = resolve(request_type.model_validate({**base, "response_format": fmt}))
        assert params is not None and params.kind == "structural_tag"
        assert completes(compiler, params, 'a <f=time>{"zone": "CET"}</f>')
        assert not completes(compiler, params, 'a <f=time>{"zone": 1}</f>')
    params = resolve(request_type.model_validate(
        {**base, "structured_outputs": {"structural_tag": json.dumps(NEW)}}))
    assert params is not None and params.cache_key()[0] == "structural_tag"


@pytest.mark.parametrize("fmt", [
    {"type": "structural_tag"},
    {"type": "structural_tag", "format": NEW["format"], **LEGACY},
    {"type": "structural_tag", "structures": LEGACY["structures"]},
    {"type": "structural_tag", "structures": [], "triggers": ["<f"]},
    {"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a"]},
    {"type": "json_object", "format": NEW["format"]},
])
def test_malformed_response_format_is_refused(fmt) -> None:
    with pytest.raises(ValidationError, match="response_format"):
        ChatCompletionRequest.model_validate({"messages": ASK, "response_format": fmt})


def test_caps_count_the_spec() -> None:
    big = {"type": "structural_tag", "format": {
        "type": "const_string", "value": "x" * 200}}
    req = ChatCompletionRequest.model_validate({"messages": ASK, "response_format": big})
    with pytest.raises(OpenAIError) as e:
        resolve(req, ServerLimits(max_structured_outputs_spec_bytes=100))
    assert e.value.param == "response_format" and "--max-structured-outputs-spec-bytes" in \
        e.value.message
    deep: dict = {"type": "string"}
    for _ in range(30):
        deep = {"type": "array", "items": deep}
    nested = {"structures": [{"begin": "<a>", "schema": deep, "end": "</a>"}],
              "triggers": ["<a"]}
    req = ChatCompletionRequest.model_validate(
        {"messages": ASK, "structured_outputs": {"structural_tag": json.dumps(nested)}})
    with pytest.raises(OpenAIError) as e:
        resolve(req)
    assert e.value.param == "structured_outputs" and "--max-structured-outputs-depth" in \
        e.value.message


# --- tool calls in the parser's own format ------------------------------------------------------

def plan(choice, options=HERMES, tools=TOOLS, parallel=True, **fields):
    req = ChatCompletionRequest.model_validate({"messages": ASK, "tools": tools,
                                                "tool_choice": choice,
                                                "parallel_tool_calls": parallel, **fields})
    p = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, options)
    params, _ = resolve_structured_outputs(req, p.constraint, ServerLimits())
    return p, params


def read_calls(parser_name: str, text: str) -> list[tuple[str, dict]]:
    out = get_tool_parser(parser_name).parse_final(text)
    return [(c.name, json.loads(c.arguments)) for c in out.calls]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_call_is_constrained_in_the_hermes_format(compiler) -> None:
    p, params = plan(NAMED)
    assert params.kind == "structural_tag" and p.parser.name == "hermes"
    good = hermes_call("get_weather", {"city": "Rome", "days": 3})
    assert completes(compiler, params, good)
    assert read_calls("hermes", good) == [("get_weather", {"city": "Rome", "days": 3})]
    jsonschema.validate(read_calls("hermes", good)[0][1], CITY)
    for bad in (hermes_call("get_weather", {"city": "Oslo", "days": 3}),  # not in the enum
                hermes_call("get_weather", {"city": "Rome"}),  # a required key missing
                hermes_call("get_time", {"zone": "UTC"}),  # another tool
                '{"city": "Rome", "days": 3}',  # the bare-JSON form
                "text " + good,  # text first
                good + "\n" + good):  # two calls
        assert not completes(compiler, params, bad), bad


def test_required_calls_one_or_more_native_calls(compiler) -> None:
    _, params = plan("required")
    one = hermes_call("get_time", {"zone": "CET"})
    two = one + "\n" + hermes_call("get_weather", {"city": "Paris", "days": 1})
    assert completes(compiler, params, one) and completes(compiler, params, two)
    assert [n for n, _ in read_calls("hermes", two)] == ["get_time", "get_weather"]
    assert not completes(compiler, params, "")
    assert not completes(compiler, params, hermes_call("nope", {"zone": "CET"}))
    assert not completes(compiler, params, hermes_call("get_time", {"zone": "X"}))
    _, single = plan("required", parallel=False)
    assert completes(compiler, single, one) and not completes(compiler, single, two)


def test_llama3_json_named_and_required(compiler) -> None:
    _, named = plan(NAMED, LLAMA)
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
    assert completes(compiler, named, call)
    assert read_calls("llama3_json", call) == [("get_weather", {"city": "Paris", "days": 2})]
    assert not completes(compiler, named, call.replace("Paris", "Oslo"))
    _, required = plan("required", LLAMA)
    two = call + '; {"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert completes(compiler, required, two)
    assert [n for n, _ in read_calls("llama3_json", two)] == ["get_weather", "get_time"]


def test_qwen3_coder_calls_are_xml_parameters_typed_by_the_schema(compiler) -> None:
    options = ChatToolOptions(tool_call_parser="qwen3_coder")
    _, named = plan(NAMED, options)
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
            "<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>")
    assert completes(compiler, named, call)
    parser = get_tool_parser("qwen3_coder").for_tools(
        ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS}).tools)
    (parsed,) = parser.parse_final(call).calls
    assert parsed.name == "get_weather"
    jsonschema.validate(json.loads(parsed.arguments), CITY)
    assert not completes(compiler, named, call.replace("Rome", "Oslo"))
    assert not completes(compiler, named, call.replace("get_weather", "get_time"))
    _, required = plan("required", options)
    two = call + "\n" + call.replace("<parameter=days>\n4", "<parameter=days>\n1")
    assert completes(compiler, required, two)
    assert len(parser.parse_final(two).calls) == 2


def test_parsers_without_a_tag_format_keep_bare_json() -> None:
    for options in (ChatToolOptions(), ChatToolOptions(tool_call_parser="mistral")):
        _, params = plan(NAMED, options)
        assert params.kind == "json" and params.json == CITY
        _, params = plan("required", options)
        assert params.kind == "json" and params.json["type"] == "array"


def test_auto_is_constrained_only_for_strict_tools(compiler) -> None:
    p, params = plan("auto")
    assert params is None and p.constraint is None  # as before: not constrained
    strict = [TOOLS[0], {"type": "function", "function": {**TOOLS[1]["function"],
                                                          "strict": True}}]
    p, params = plan("auto", tools=strict)
    assert params.kind == "structural_tag" and p.free_text
    weather = hermes_call("get_weather", {"city": "Rome", "days": 2})
    assert completes(compiler, params, "No call needed.")
    assert completes(compiler, params, "<think>hm</think>Let me look. " + weather)
    assert not completes(compiler, params, "x " + hermes_call("get_weather", {"city": "X"}))
    # The non-strict tool: its name is one of the tools, its arguments any object.
    assert completes(compiler, params, hermes_call("get_time", {"any": [1]}))
    assert not completes(compiler, params, hermes_call("nope", {}))
    # The request's own constraint wins: the calls are then not constrained (as before).
    _, params = plan("auto", tools=strict, response_format={"type": "json_object"})
    assert params.kind == "json_object"


def test_tool_tags_follow_the_whitespace_fields(compiler) -> None:
    spaced = '<tool_call>\n{"name": "get_time", "arguments": {"zone":      "UTC"}}\n</tool_call>'
    _, params = plan({"type": "function", "function": {"name": "get_time"}})
    assert not completes(compiler, params, spaced)
    _, params = plan({"type": "function", "function": {"name": "get_time"}},
                     structured_outputs={"max_whitespace_cnt": None})
    assert completes(compiler, params, spaced)
    _, params = plan({"type": "function", "function": {"name": "get_time"}},
                     structured_outputs={"disable_any_whitespace": True})
    assert params.whitespace() == "compact"
    assert completes(compiler, params, hermes_call("get_time", {"zone": "UTC"}))
    assert not completes(compiler, params, spaced)
