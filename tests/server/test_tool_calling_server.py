"""Tool calling, structured output and reasoning over HTTP on a real ``pagellm serve`` with a tiny
random-weight model (its words are noise; the constraints decide what matters) and the openai
SDK as the client. The server (the shared ``tools_server``) runs --enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser deepseek_r1 --chat-template chatml_tools."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_utils import TOOLS_KEY, post

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# A regex that makes the (random) model answer with hermes calls, to exercise tool_choice auto.
CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
        r'"unit": "celsius"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=TOOLS_KEY, max_retries=0,
                         timeout=120)


def assemble_stream(chunks):
    """(content, reasoning, {index: [id, name, arguments]}, finish_reason) of a chat stream."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, [call.id, None, ""])
            if call.function.name:
                entry[1] = call.function.name
            entry[2] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


def test_auto_tool_choice_reads_hermes_calls(client):
    extra = {"structured_outputs": {"regex": CALL + "\n" + CALL}}
    resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER_TOOL],
                                          max_tokens=400, extra_body=extra)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments),
                            WEATHER_TOOL["function"]["parameters"])
    assert calls[0].id != calls[1].id

    # Streamed, with parallel_tool_calls false: the first call only.
    content, _, streamed, finish = assemble_stream(client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=400, extra_body=extra,
        temperature=0, stream=True, parallel_tool_calls=False))
    assert finish == "tool_calls" and content == ""
    ((call_id, name, arguments),) = streamed.values()
    assert call_id and name == "get_weather" and json.loads(arguments)["unit"] == "celsius"


def test_named_tool_choice_streams_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(model="m", messages=MESSAGES,
                                          tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named,
                                          max_tokens=200, temperature=0)
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "get_time" and resp.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])

    _, _, calls, finish = assemble_stream(client.chat.completions.create(
        model="m", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named,
        max_tokens=200, temperature=0, stream=True))
    ((call_id, name, arguments),) = calls.values()
    assert call_id and name == "get_time" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), TIME_TOOL["function"]["parameters"])


def test_required_tool_choice(client):
    tools = [WEATHER_TOOL, TIME_TOOL]
    for stream in (False, True):
        resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=tools,
                                              tool_choice="required", max_tokens=400,
                                              stream=stream, temperature=0)
        if stream:
            _, _, calls, finish = assemble_stream(resp)
            calls = [(n, a) for _, n, a in calls.values()]
        else:
            finish = resp.choices[0].finish_reason
            calls = [(c.function.name, c.function.arguments)
                     for c in resp.choices[0].message.tool_calls]
        assert finish == "tool_calls" and calls
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), by_name[name])


def test_reasoning_parser_splits_the_answer(server, client):
    """deepseek_r1: the answer before </think> is reasoning. The model never writes </think>,
    so the whole greedy answer, which /v1/completions gives for the same prompt, is reasoning."""
    ids = post(server, "/tokenize", {"messages": MESSAGES})
    assert ids.status_code == 200, ids.text
    text = client.completions.create(model="m", prompt=ids.json()["tokens"], max_tokens=12,
                                      temperature=0).choices[0].text
    assert "</think>" not in text
    resp = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12,
                                          temperature=0)
    message = resp.choices[0].message
    assert message.model_extra["reasoning_content"] == text and message.content is None
    _, reasoning, _, _ = assemble_stream(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=12, temperature=0, stream=True))
    assert reasoning == text


def test_structured_output_on_completions(client):
    resp = client.completions.create(model="m", prompt="The answer is", max_tokens=20,
                                     extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert resp.choices[0].text in ("yes", "no", "maybe")
    resp = client.completions.create(model="m", prompt="A code:", max_tokens=20,
                                     extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", resp.choices[0].text)


def test_tool_history_renders_with_the_tools(server, client):
    """The prompt the server counted is the chat template's rendering of the tools and the
    whole tool exchange (computed here with the same template and tokenizer)."""
    from tiny_tokenizer import build_test_tokenizer

    from pagellm.entrypoints.openai.serving_chat import load_chat_template

    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {
                       "name": "get_weather",
                       "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    resp = client.chat.completions.create(model="m", messages=history, tools=[WEATHER_TOOL],
                                          tool_choice="none", max_tokens=4)
    template_history = json.loads(json.dumps(history))
    template_history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris",
                                                                     "unit": "celsius"}
    template_history[1]["content"] = ""
    text = build_test_tokenizer().apply_chat_template(
        template_history, tools=[WEATHER_TOOL], chat_template=load_chat_template("chatml_tools"),
        tokenize=False, add_generation_prompt=True)
    assert '{"city": "Paris", "unit": "celsius"}' in text and "18 degrees" in text
    expected = len(build_test_tokenizer().encode(text, add_special_tokens=False))
    assert resp.usage.prompt_tokens == expected


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format", ""),
    ({"guided_regex": "(unclosed"}, "guided_regex", "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice",
     "response_format, guided_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format, tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not among the tools"),
])
def test_bad_constraints_are_a_400_naming_the_field(server, body, param, needle):
    resp = post(server, "/v1/chat/completions",
                {"messages": MESSAGES, "max_tokens": 4, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and needle in err["message"], err
