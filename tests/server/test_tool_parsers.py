"""Tool-call parsers on realistic model answers: the non-streaming result, and the streamed
deltas (text cut into token-sized pieces) joined back up, which must give the same content,
names and arguments; the first delta of a call carries its id, type and name."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from pagellm.entrypoints.openai.chat_tools import (
    ChatToolOptions,
    plan_tools,
    required_tools_schema,
)
from pagellm.entrypoints.openai.protocol_tools import ChatTool, NamedToolChoice
from pagellm.entrypoints.openai.serving_errors import OpenAIError
from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.forced_tool_parsers import (
    NamedFunctionParser,
    RequiredToolsParser,
)
from pagellm.entrypoints.openai.tool_parsers.tool_call_streamer import (
    ToolCallStreamer,
    extract_tool_calls,
)

WEATHER = {"location": "San Francisco, CA, USA", "unit": "celsius"}
DATE = {"location": "Paris", "date": "2024-10-01", "tags": ["a", "b\"}"], "nested": {"k": [1, 2]}}

# (parser, model answer, expected content, expected [(name, arguments dict)])
CASES = [
    ("hermes",  # Qwen2.5-Instruct: text, then two calls
     "I'll check both.\n<tool_call>\n"
     '{"name": "get_current_temperature", "arguments": ' + json.dumps(WEATHER) + "}\n"
     "</tool_call>\n<tool_call>\n"
     '{"name": "get_temperature_date", "arguments": ' + json.dumps(DATE) + "}\n</tool_call>",
     "I'll check both.\n",
     [("get_current_temperature", WEATHER), ("get_temperature_date", DATE)]),
    ("hermes",  # a call and nothing else
     '<tool_call>\n{"name": "get_current_temperature", "arguments": '
     + json.dumps(WEATHER) + "}\n</tool_call>",
     None, [("get_current_temperature", WEATHER)]),
    ("hermes",  # no call: the whole answer is content
     "The temperature in Paris is 18 degrees <celsius>.", "The temperature in Paris is 18 "
     "degrees <celsius>.", []),
    ("llama3_json",  # Llama 3.1: a bare JSON object
     '{"name": "get_current_temperature", "parameters": ' + json.dumps(WEATHER) + "}",
     None, [("get_current_temperature", WEATHER)]),
    ("llama3_json",  # python_tag and two calls separated by ;
     '<|python_tag|>{"name": "get_current_temperature", "parameters": ' + json.dumps(WEATHER)
     + '}; {"name": "get_temperature_date", "parameters": ' + json.dumps(DATE) + "}",
     None, [("get_current_temperature", WEATHER), ("get_temperature_date", DATE)]),
    ("llama3_json", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    ("llama3_json",  # JSON that is not a call stays content
     '{"answer": 42}', '{"answer": 42}', []),
    ("mistral",  # Mistral 7B v0.3 / Nemo
     '[TOOL_CALLS][{"name": "get_current_temperature", "arguments": ' + json.dumps(WEATHER)
     + '}, {"name": "get_temperature_date", "arguments": ' + json.dumps(DATE) + "}]",
     None, [("get_current_temperature", WEATHER), ("get_temperature_date", DATE)]),
    ("mistral",  # Mistral Small 3.2 (tokenizer v11): name[ARGS]{...} per call
     "Let me see. [TOOL_CALLS]get_current_temperature[ARGS]" + json.dumps(WEATHER)
     + "[TOOL_CALLS]get_temperature_date[ARGS]" + json.dumps(DATE),
     "Let me see. ", [("get_current_temperature", WEATHER), ("get_temperature_date", DATE)]),
    ("mistral", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
]


# A malformed call (unclosed object) is content when the whole answer is read, as vLLM does;
# a stream has sent the call's name by the time the answer goes wrong.
MALFORMED = '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'


def test_a_malformed_call_is_content():
    assert extract_tool_calls(get_tool_parser("hermes"), MALFORMED) == (MALFORMED, [])


def pieces(text: str, seed: int) -> list[str]:
    """``text`` cut into pieces of 1 to 6 characters, as tokens arrive."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


def stream(parser, text: str, seed: int, max_calls: int | None = None):
    """(content, [(id, name, arguments)], the deltas) from streaming ``text``."""
    streamer = ToolCallStreamer(parser, max_calls)
    parts = pieces(text, seed)
    content, calls, deltas = "", {}, []
    for i, part in enumerate(parts):
        c, ds = streamer.feed(part, final=i == len(parts) - 1)
        content += c
        deltas.extend(ds)
        for d in ds:
            if d.index not in calls:
                # The first delta of a call: id, type and name.
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = [d.id, d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None, d
            calls[d.index][2] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_non_streaming(name, text, content, expected):
    got_content, calls = extract_tool_calls(get_tool_parser(name), text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("name", "text", "content", "expected"), CASES)
def test_streaming_joins_up_to_non_streaming(name, text, content, expected, seed):
    parser = get_tool_parser(name)
    got_content, calls, _ = stream(parser, text, seed)
    assert got_content == (content or "")
    assert [(n, json.loads(a)) for _, n, a in calls] == expected
    _, whole = extract_tool_calls(parser, text)
    assert [a for _, _, a in calls] == [c.function.arguments for c in whole]


def test_arguments_stream_before_the_call_ends():
    text = CASES[1][1]
    parser = get_tool_parser("hermes")
    _, _, deltas = stream(parser, text, seed=0)
    # Several argument fragments, not one at the end.
    assert sum(1 for d in deltas if d.function.arguments) > 3


def test_content_before_a_call_streams_and_the_marker_never_shows():
    parser = get_tool_parser("hermes")
    streamer = ToolCallStreamer(parser)
    assert streamer.feed("Let me check", False) == ("Let me check", [])
    assert streamer.feed(" <tool_", False) == (" ", [])  # "<tool_" may start a marker
    content, deltas = streamer.feed('call>\n{"name": "f", "arguments": {"x": 1}}', False)
    assert content == "" and deltas[0].function.name == "f"
    assert deltas[0].function.arguments == '{"x": 1}'
    content, deltas = streamer.feed("\n</tool_call>", True)
    assert content == "" and deltas == []


def test_parallel_tool_calls_false_keeps_the_first_call():
    name, text, _, expected = CASES[0]
    parser = get_tool_parser(name)
    _, calls = extract_tool_calls(parser, text, max_calls=1)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected[:1]
    _, streamed, _ = stream(parser, text, seed=1, max_calls=1)
    assert [n for _, n, _ in streamed] == [expected[0][0]]


def test_forced_parsers():
    named = NamedFunctionParser("get_weather")
    args = json.dumps(WEATHER)
    content, calls = extract_tool_calls(named, args)
    assert content is None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == WEATHER
    _, streamed, _ = stream(named, args, seed=2)
    assert streamed[0][1:] == ("get_weather", args)

    required = RequiredToolsParser()
    text = json.dumps([{"name": "a", "parameters": WEATHER}, {"name": "b", "parameters": DATE}])
    _, calls = extract_tool_calls(required, text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("a", WEATHER), ("b", DATE)]
    _, streamed, _ = stream(required, text, seed=3)
    assert [(n, json.loads(a)) for _, n, a in streamed] == [("a", WEATHER), ("b", DATE)]
    # Cut short (max_tokens): no call, the text is content.
    content, calls = extract_tool_calls(required, text[:20])
    assert calls == [] and content == text[:20]


TOOLS = [ChatTool.model_validate(t) for t in [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"room": {"$ref": "#/$defs/Room"}},
        "required": ["room"], "$defs": {"Room": {"type": "object", "properties": {
            "beds": {"type": "integer"}}, "required": ["beds"]}}}}},
]]


def test_required_schema_accepts_calls_of_the_tools_only():
    schema = required_tools_schema(TOOLS, None)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}},
             {"name": "book", "parameters": {"room": {"beds": 2}}}]
    jsonschema.validate(valid, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"unit": "c"}}],
                [{"name": "book", "parameters": {"room": {"beds": "two"}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = required_tools_schema(TOOLS, 1)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid, one)


AUTO = ChatToolOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_tool_choice_plans():
    plan = plan_tools(TOOLS, None, True, AUTO)  # tools without tool_choice: auto
    assert plan.parser.name == "hermes" and plan.constraint is None
    assert [t["function"]["name"] for t in plan.template_tools] == ["get_weather", "book"]
    plan = plan_tools(TOOLS, "none", True, AUTO)
    assert plan.parser is None and plan.template_tools is not None  # as vLLM
    assert plan_tools(TOOLS, "none", True, ChatToolOptions(
        exclude_tools_when_tool_choice_none=True)).template_tools is None
    named = NamedToolChoice.model_validate({"type": "function",
                                            "function": {"name": "book"}})
    plan = plan_tools(TOOLS, named, True, ChatToolOptions())
    assert plan.constraint.value == TOOLS[1].function.parameters
    plan = plan_tools(TOOLS, "required", False, ChatToolOptions())
    assert plan.constraint.value["maxItems"] == 1 and plan.max_calls == 1


@pytest.mark.parametrize(("tools", "choice", "options", "needle"), [
    (TOOLS, "auto", ChatToolOptions(), "--enable-auto-tool-choice"),
    (TOOLS, None, ChatToolOptions(), "--enable-auto-tool-choice"),
    (None, "required", AUTO, "needs tools"),
    (TOOLS, NamedToolChoice.model_validate({"function": {"name": "nope"}}), AUTO,
     "not among the tools"),
])
def test_tool_choice_errors_name_the_field(tools, choice, options, needle):
    with pytest.raises(OpenAIError) as e:
        plan_tools(tools, choice, True, options)
    assert e.value.status == 400 and e.value.param == "tool_choice"
    assert needle in e.value.message


def test_server_options_are_checked_at_start():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatToolOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown parser"):
        ChatToolOptions(tool_call_parser="nope")
