"""qwen3_coder through a real ``pagellm serve`` (tiny random-weight model, openai SDK): a regex
makes the model write Qwen3-Coder's XML calls, and the server's answer types each value by the
request's tools (an integer parameter comes back a JSON number, a string parameter that looks
like a number stays a string), streamed and not."""

from __future__ import annotations

import json

import openai
import pytest
from server_utils import serve_tiny_llama

ARGS = ["--served-model-name", "m", "--dtype", "float32", "--max-model-len", "2048",
        "--kv-cache-memory", "16MiB", "--enable-auto-tool-choice",
        "--tool-call-parser", "qwen3_coder", "--chat-template", "chatml_tools"]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
CALL = (r"<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|1999)\n</parameter>\n"
        r"<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>")
EXTRA = {"structured_outputs": {"regex": "Checking\\.\n" + CALL}}


@pytest.fixture(scope="module")
def client(tmp_path_factory, make_tiny_model):
    for server in serve_tiny_llama(tmp_path_factory, make_tiny_model, "qwen3_coder", ARGS,
                                   max_position_embeddings=2048):
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                            timeout=120)


def test_qwen3_coder_calls_are_typed_by_the_request_tools(client):
    resp = client.chat.completions.create(model="m", messages=MESSAGES, tools=[TOOL],
                                          max_tokens=200, extra_body=EXTRA)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather"
    assert isinstance(args["city"], str) and args["city"] in ("Paris", "1999")
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 9

    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, tools=[TOOL],
                                                max_tokens=200, extra_body=EXTRA,
                                                stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, [d.id, d.function.name, ""])
            entry[2] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "Checking.\n"
    ((call_id, name, arguments),) = calls.values()
    streamed = json.loads(arguments)
    assert call_id and name == "get_weather" and isinstance(streamed["days"], int)
    assert isinstance(streamed["city"], str)
