"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) on a real ``pagellm serve``
of a tiny random-weight model, with the anthropic SDK (its stream accumulator is the referee of
the events) and litellm's anthropic route as clients. The server runs
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3
--chat-template chatml_tools --api-key KEY. Thinking blocks are checked by feeding a known
answer through the same translation (the random model never writes <think>)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import httpx2
import jsonschema
import litellm
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from server_utils import serve_tiny_llama

from pagellm.entrypoints.anthropic.errors import exception_response
from pagellm.entrypoints.anthropic.stream import BlockEvents
from pagellm.entrypoints.anthropic.translate import content_blocks, stop_reason
from pagellm.entrypoints.openai.chat_output import ChatReading
from pagellm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagellm.entrypoints.openai.serving_engine import retry_later

KEY = "sk-anthropic-test"
ARGS = ["--served-model-name", "m", "--dtype", "float32", "--max-model-len", "2048",
        "--kv-cache-memory", "16MiB", "--api-key", KEY,
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--chat-template", "chatml_tools"]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # this SDK has no temperature argument: the body's field


@pytest.fixture(scope="module")
def server(tmp_path_factory, make_tiny_model):
    yield from serve_tiny_llama(tmp_path_factory, make_tiny_model, "anthropic", ARGS,
                                max_position_embeddings=2048)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0,
                               timeout=120)


def shape(message) -> dict:
    """A message without its random ids."""
    data = message.model_dump(exclude_none=True)
    data.pop("id")
    for block in data["content"]:
        block.pop("id", None)
    return data


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed request, read off the wire."""
    events, name = [], None
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                events.append((name, data))
    return events


def check_event_order(events: list[tuple[str, dict]]) -> None:
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] == open_index
            if name == "content_block_stop":
                open_index = None
        else:
            assert name == "ping", name
    assert open_index is None


def test_create_system_multi_turn_and_usage(client):
    resp = client.messages.create(
        model="m", max_tokens=12, system=[{"type": "text", "text": "You are terse."}],
        messages=[{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Weather?"}]}],
        metadata={"user_id": "u1"}, extra_body=GREEDY)
    assert resp.id.startswith("msg_") and resp.type == "message" and resp.role == "assistant"
    assert resp.model == "m"
    assert [b.type for b in resp.content] == ["text"] and resp.content[0].text
    assert resp.stop_reason == "max_tokens" and resp.stop_sequence is None
    assert resp.usage.output_tokens == 12
    assert resp.usage.cache_read_input_tokens == 0
    assert resp.usage.cache_creation_input_tokens == 0
    # The system prompt and every turn reach the prompt.
    shorter = client.messages.count_tokens(model="m", messages=[
        {"role": "user", "content": "Weather?"}])
    assert resp.usage.input_tokens > shorter.input_tokens


def test_stop_sequences(client):
    full = client.messages.create(model="m", max_tokens=30, messages=USER, extra_body=GREEDY)
    text = full.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    resp = client.messages.create(model="m", max_tokens=30, messages=USER,
                                  stop_sequences=["never-there", stop], extra_body=GREEDY)
    assert resp.stop_reason == "stop_sequence" and resp.stop_sequence == stop
    assert resp.content[0].text == text[:text.index(stop)]
    assert resp.usage.output_tokens < full.usage.output_tokens


def test_count_tokens_equals_input_tokens(client):
    body = {"model": "m", "system": "Be brief.", "messages": USER, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    counted = client.messages.count_tokens(**body)
    resp = client.messages.create(max_tokens=60, extra_body=GREEDY, **body)
    assert counted.input_tokens == resp.usage.input_tokens > 0


def test_stream_matches_create_and_event_order(server, client):
    body = {"model": "m", "max_tokens": 16, "messages": USER}
    created = client.messages.create(**body, extra_body=GREEDY)
    with client.messages.stream(**body, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert shape(final) == shape(created)
    assert "".join(texts) == created.content[0].text
    events = raw_events(server, {**body, **GREEDY})
    check_event_order(events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == created.usage.input_tokens
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 16


def test_tool_round_trip(server, client):
    body = {"model": "m", "max_tokens": 200, "messages": USER, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    resp = client.messages.create(**body, extra_body=GREEDY)
    assert resp.stop_reason == "tool_use"
    (call,) = [b for b in resp.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])

    # Streamed: input_json_delta pieces that the SDK joins into the same input.
    with client.messages.stream(**body, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert shape(final) == shape(resp)
    events = raw_events(server, {**body, **GREEDY})
    check_event_order(events)
    assert any(d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
               for _, d in events)

    # The result goes back; the next answer is text (auto: the model may call again).
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"}
    follow = [*USER, {"role": "assistant", "content": [b.model_dump() for b in resp.content]},
              {"role": "user", "content": [result]}]
    nxt = client.messages.create(model="m", max_tokens=10, messages=follow, tools=[WEATHER],
                                 extra_body=GREEDY)
    assert nxt.stop_reason in ("max_tokens", "end_turn", "tool_use") and nxt.content
    assert nxt.usage.input_tokens > resp.usage.input_tokens
    # The result's text (and is_error) reach the prompt.
    counts = [client.messages.count_tokens(model="m", tools=[WEATHER], messages=[
        *follow[:2], {"role": "user", "content": [{**result, **extra}]}]).input_tokens
        for extra in ({}, {"content": [{"type": "text", "text": "18 degrees, sunny"}]},
                      {"is_error": True})]
    assert counts[0] == nxt.usage.input_tokens
    assert counts[1] > counts[0] and counts[2] > counts[0]


def test_any_tool_choice_single_call(client):
    resp = client.messages.create(model="m", max_tokens=400, messages=USER, tools=[WEATHER],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  extra_body=GREEDY)
    calls = [b for b in resp.content if b.type == "tool_use"]
    assert resp.stop_reason == "tool_use" and len(calls) == 1
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])


def test_auth_headers_and_errors(server):
    url = f"{server.base_url}/v1/messages"
    body = {"model": "m", "max_tokens": 2, "messages": USER}
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(**body).stop_reason
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong",
                            max_retries=0).messages.create(**body)
    for headers in ({"x-api-key": "wrong"}, {}):
        resp = httpx.post(url, json=body, headers=headers, timeout=60)
        assert resp.status_code == 401
        assert resp.json()["type"] == "error"
        assert resp.json()["error"]["type"] == "authentication_error"
    # OpenAI's routes keep OpenAI's 401 body, and take x-api-key too.
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                      json={"model": "m", "messages": USER, "max_tokens": 1})
    assert resp.status_code == 401 and "error" in resp.json() and "type" not in resp.json()
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"x-api-key": KEY},
                      json={"model": "m", "messages": USER, "max_tokens": 1}, timeout=60)
    assert resp.status_code == 200


@pytest.mark.parametrize(("body", "status", "err_type", "words"), [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]},
     400, "invalid_request_error", ["messages.0.content.0.type", "'image'"]),
    ({"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "x"}}]}]},
     400, "invalid_request_error", ["'document'"]),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
     400, "invalid_request_error", ["mcp_servers"]),
    ({"frobnicate": 1}, 400, "invalid_request_error", ["frobnicate", "Extra inputs"]),
    ({"max_tokens": None}, 400, "invalid_request_error", ["max_tokens"]),
    ({"temperature": 1.5}, 400, "invalid_request_error", ["temperature"]),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", ["tools.0.type", "web_search_20250305"]),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}},
     400, "invalid_request_error", ["budget_tokens", "1024"]),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
     400, "invalid_request_error", ["nope"]),
    ({"model": "other"}, 404, "not_found_error", ["other"]),
])
def test_errors_are_anthropic_shaped(server, body, status, err_type, words):
    full = {"model": "m", "max_tokens": 4, "messages": USER, **body}
    resp = httpx.post(f"{server.base_url}/v1/messages", json=full, timeout=60,
                      headers={"x-api-key": KEY})
    assert resp.status_code == status, resp.text
    data = resp.json()
    assert data["type"] == "error" and data["error"]["type"] == err_type
    for word in words:
        assert word in data["error"]["message"], data


def test_invalid_json_and_sdk_error_class(server, client):
    resp = httpx.post(f"{server.base_url}/v1/messages", content=b"{not json", timeout=60,
                      headers={"x-api-key": KEY, "content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="m", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": "http://example.invalid/x.png"}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"


def test_thinking_enabled_is_accepted(client):
    # qwen3's parser reads a block only when the answer opens with <think>, which the random
    # model's does not: the answer stays text. The budget must stay below max_tokens, so a
    # stop sequence from the greedy answer ends it early.
    text = client.messages.create(model="m", max_tokens=12, messages=USER,
                                  extra_body=GREEDY).content[0].text
    stop = text[4:7]
    thinking = {"type": "enabled", "budget_tokens": 1024}
    resp = client.messages.create(model="m", max_tokens=1025, messages=USER, thinking=thinking,
                                  stop_sequences=[stop], extra_body=GREEDY)
    assert resp.stop_reason == "stop_sequence" and resp.content[0].text == text[:text.index(stop)]
    assert client.messages.count_tokens(model="m", messages=USER, thinking=thinking
                                        ).input_tokens == resp.usage.input_tokens


def test_litellm_anthropic_route(server):
    resp = asyncio.run(litellm.anthropic.messages.acreate(
        model="anthropic/m", messages=USER, max_tokens=5, api_base=server.base_url,
        api_key=KEY, temperature=0))
    data = resp if isinstance(resp, dict) else resp.model_dump()
    assert data["type"] == "message" and data["stop_reason"] == "max_tokens"
    assert data["content"][0]["type"] == "text" and data["usage"]["output_tokens"] == 5


# The translation of a known answer with a thinking block, whole and streamed (char by char):
# the SDK's accumulator joins the events into the blocks of the whole answer.
THOUGHT = "<think>The user asks about Paris.</think>It is sunny."


def test_thinking_blocks_whole_and_streamed():
    reading = ChatReading(None, None, get_reasoning_parser("qwen3"))
    message, finish = reading.message(THOUGHT, "stop")
    blocks = content_blocks(message)
    assert blocks == [{"type": "thinking", "thinking": "The user asks about Paris.",
                       "signature": ""}, {"type": "text", "text": "It is sunny."}]
    assert stop_reason(finish, None, None) == ("end_turn", None)

    deltas, events = reading.choice_deltas(), BlockEvents()
    wire = []
    for i, ch in enumerate(THOUGHT):
        delta, _ = deltas.feed(ch, "stop" if i == len(THOUGHT) - 1 else None)
        if delta is not None:
            wire += events.feed(delta)
    wire += events.close()
    start = {"type": "message_start", "message": {
        "id": "msg_x", "type": "message", "role": "assistant", "model": "m", "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 0}}}
    snapshot = accumulate_event(event=start, current_snapshot=None, json_bufs={})
    kinds = []
    for raw in wire:
        name_line, data_line = raw.strip().split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        kinds.append(data.get("delta", {}).get("type", data["type"]))
        snapshot = accumulate_event(event=data, current_snapshot=snapshot, json_bufs={})
    assert [b.model_dump(exclude_none=True) for b in snapshot.content] == blocks
    runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert runs == ["content_block_start", "thinking_delta", "signature_delta",
                    "content_block_stop", "content_block_start", "text_delta",
                    "content_block_stop"]


def test_overload_is_anthropic_529():
    # What the OpenAI routes answer 503 (a full queue) is Anthropic's overloaded_error, 529,
    # which the SDK maps to OverloadedError (and retries, after Retry-After).
    resp = exception_response(retry_later("The server is overloaded: the waiting queue is full."))
    assert resp.status_code == 529 and resp.headers["retry-after"] == "1"
    body = json.loads(bytes(resp.body))
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    # The SDK's own reading of that response.
    transport = httpx2.MockTransport(lambda request: httpx2.Response(
        resp.status_code, headers=dict(resp.headers), content=bytes(resp.body)))
    sdk = anthropic.Anthropic(api_key="x", base_url="http://pagellm.invalid", max_retries=0,
                              http_client=httpx2.Client(transport=transport))
    with pytest.raises(anthropic.OverloadedError):
        sdk.messages.create(model="m", max_tokens=1, messages=USER)
