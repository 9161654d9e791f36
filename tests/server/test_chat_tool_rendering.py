"""Tool-calling conversations through the chat template: --chat-template by name (the shipped
chatml_tools), tools reaching the template, assistant tool_calls with JSON-text arguments turned
into dicts, tool messages with their tool_call_id."""

from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.protocol import ChatMessage
from pagellm.entrypoints.openai.serving_chat import ChatRenderer, load_chat_template
from pagellm.entrypoints.openai.serving_errors import OpenAIError
from pagellm.entrypoints.openai.templates import shipped_template_names

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24C, cloudy"},
]
EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\n<tools>\n" + json.dumps(TOOL["function"]) + "\n</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
    "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", "
    "\"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n<tool_response>\n"
    "24C, cloudy\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def renderer():
    from tiny_tokenizer import build_test_tokenizer

    return ChatRenderer(build_test_tokenizer(), load_chat_template("chatml_tools"))


def render_text(renderer, messages, tools=None) -> str:
    ids = renderer.render([ChatMessage.model_validate(m) for m in messages], tools=tools)
    return renderer.tokenizer.decode(ids)


def test_shipped_template_by_name():
    assert "chatml_tools" in shipped_template_names()
    assert "<tool_call>" in load_chat_template("chatml_tools")
    with pytest.raises(ValueError, match="chatml_tools"):
        load_chat_template("no_such_template")


def test_tools_and_tool_history_reach_the_template(renderer):
    assert render_text(renderer, HISTORY, [TOOL]) == EXPECTED


def test_without_tools_it_is_plain_chatml(renderer):
    text = render_text(renderer, [{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_arguments_that_are_not_json_are_a_400(renderer):
    bad = [dict(m) for m in HISTORY]
    bad[2] = {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{city"}}]}
    with pytest.raises(OpenAIError) as e:
        render_text(renderer, bad, [TOOL])
    assert e.value.param == "messages" and "messages[2].tool_calls[0]" in e.value.message


def test_an_assistant_turn_s_reasoning_content_reaches_the_template():
    from tiny_tokenizer import build_test_tokenizer

    template = ("{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '-' }}:"
                "{{ m.content }};{% endfor %}")
    renderer = ChatRenderer(build_test_tokenizer(), template)
    text = render_text(renderer, [
        {"role": "user", "content": "Hi", "reasoning_content": "not an assistant's"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}])
    assert text == "user:-:Hi;assistant:greet back:Hello;"
