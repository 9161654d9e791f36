"""POST /v1/responses (and the response store) on a real ``pagellm serve`` with a tiny
random-weight model, the openai SDK (``responses.create``, the ``responses.stream`` helper that
accumulates and checks the events) and the OpenAI Agents SDK as the clients. The model's words
are noise: with --reasoning-parser deepseek_r1 a free answer is all reasoning; text.format and a
named tool_choice constrain the answer, so those are where the text and the calls come from."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_utils import TOOLS_KEY, TOOLS_KEY_B, drained, wait_until

from pagellm.entrypoints.openai.response_store import ResponseStore, StoredResponse

KEY_A, KEY_B = TOOLS_KEY, TOOLS_KEY_B  # the shared tools_server's two tenants
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Paris", "Rome"]},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
FORCE_WEATHER = {"type": "function", "name": "get_weather"}
CITY_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"], "additionalProperties": False}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA,
                          "strict": True}}


@pytest.fixture(scope="module")
def server(tools_server):
    return tools_server


def make_client(server, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return make_client(server)


def prompt_tokens(server, messages: list[dict]) -> int:
    """The chat template's token count of ``messages`` (the server's own /tokenize)."""
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages},
                   headers={"Authorization": f"Bearer {KEY_A}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def error_of(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_string_input_is_incomplete_at_max_output_tokens(server, client):
    resp = client.responses.create(model="m", input="What is the weather?",
                                   max_output_tokens=8, temperature=0)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 8
    assert resp.usage.total_tokens == resp.usage.input_tokens + 8
    assert resp.usage.input_tokens == prompt_tokens(
        server, [{"role": "user", "content": "What is the weather?"}])
    # deepseek_r1 reads an answer without </think> as reasoning: one reasoning item, cut.
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning"], kinds
    assert resp.output[0].content[0].text and resp.output[0].status == "incomplete"
    assert resp.usage.output_tokens_details.reasoning_tokens > 0
    assert resp.output_text == ""
    # The echoed settings.
    assert resp.max_output_tokens == 8 and resp.temperature == 0
    assert resp.tools == [] and resp.tool_choice == "auto" and resp.parallel_tool_calls
    assert resp.text.format.type == "text" and resp.store is True


def test_items_and_instructions_render_as_chat_messages(server, client):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "user", "content": "Weather?"}]
    resp = client.responses.create(model="m", input=items, instructions="You are a test.",
                                   max_output_tokens=2, store=False)
    assert resp.instructions == "You are a test."
    assert resp.usage.input_tokens == prompt_tokens(server, [
        {"role": "system", "content": "You are a test."},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather?"}])
    # store false: nothing to retrieve.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_json_schema_format(client):
    resp = client.responses.create(model="m", input="Which city?", text=JSON_FORMAT,
                                   max_output_tokens=200, temperature=0)
    assert resp.status == "completed", resp
    assert [item.type for item in resp.output] == ["message"]
    jsonschema.validate(json.loads(resp.output_text), CITY_SCHEMA)
    assert resp.text.format.type == "json_schema"


def check_events(events: list) -> dict:
    """The stream's rules; returns the final response event's response."""
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0, numbers
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete"), final.type
    opened: dict[int, object] = {}
    parts_open, texts, arguments = set(), {}, {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index not in opened and e.output_index == len(opened)
            opened[e.output_index] = e.item.id
        elif e.type == "response.output_item.done":
            assert opened.pop(e.output_index) == e.item.id
            opened[e.output_index] = None  # closed
        elif e.type == "response.content_part.added":
            parts_open.add((e.item_id, e.content_index))
        elif e.type == "response.content_part.done":
            parts_open.remove((e.item_id, e.content_index))
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            assert (e.item_id, e.content_index) in parts_open
            texts[e.item_id] = texts.get(e.item_id, "") + e.delta
        elif e.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert e.text == texts.get(e.item_id, "")
        elif e.type == "response.function_call_arguments.delta":
            arguments[e.item_id] = arguments.get(e.item_id, "") + e.delta
        elif e.type == "response.function_call_arguments.done":
            assert e.arguments == arguments.get(e.item_id, "")
        else:
            raise AssertionError(f"unexpected event {e.type}")
    assert all(v is None for v in opened.values()) and not parts_open  # every .added done
    return final.response


def wire(resp) -> dict:
    """A response as the server sent it (without what the stream helper adds)."""
    out = resp.model_dump()
    for item in out["output"]:
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return out


def comparable(resp) -> dict:
    """A response without what differs between two runs of the same request (ids, times)."""
    out = wire(resp)
    for key in ("id", "created_at", "completed_at"):
        out.pop(key, None)
    for item in out["output"]:
        item.pop("id")
        item.pop("call_id", None)
    return out


@pytest.mark.parametrize("kwargs", [
    {"input": "Tell me something.", "max_output_tokens": 12},  # reasoning, cut
    {"input": "Which city?", "text": JSON_FORMAT, "max_output_tokens": 200},  # text
    {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": FORCE_WEATHER,
     "max_output_tokens": 200},  # a function call
], ids=["reasoning", "text", "function_call"])
def test_stream_events_match_the_response(client, kwargs):
    with client.responses.stream(model="m", temperature=0, **kwargs) as stream:
        events = list(stream)
        final = check_events(events)
        if events[-1].type == "response.completed":
            assert stream.get_final_response().model_dump() == final.model_dump()
    plain = client.responses.create(model="m", temperature=0, **kwargs)
    assert comparable(final) == comparable(plain)
    # The stored copy of the streamed response is the one its last event carried.
    assert wire(client.responses.retrieve(final.id)) == wire(final)


def test_forced_tool_call_round_trip(server, client):
    question = {"role": "user", "content": "Weather in Paris?"}
    first = client.responses.create(model="m", input=[question], tools=[WEATHER],
                                    tool_choice=FORCE_WEATHER, max_output_tokens=200)
    assert first.status == "completed", first
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answer = {"type": "function_call_output", "call_id": call.call_id,
              "output": "Sunny, 21 degrees."}
    # The result fed back, as the whole conversation or after previous_response_id.
    explicit = client.responses.create(
        model="m", input=[question, call.model_dump(exclude_none=True), answer],
        tools=[WEATHER], tool_choice="none", max_output_tokens=4)
    chained = client.responses.create(model="m", input=[answer],
                                      previous_response_id=first.id, tools=[WEATHER],
                                      tool_choice="none", max_output_tokens=4)
    assert chained.previous_response_id == first.id
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.usage.input_tokens > first.usage.input_tokens + len(call.arguments) // 8


def test_previous_response_id_counts_the_first_turn(server, client):
    first = client.responses.create(model="m", input="Which city?", text=JSON_FORMAT,
                                    max_output_tokens=200)
    second = client.responses.create(model="m", input="And tomorrow?",
                                     previous_response_id=first.id, max_output_tokens=2)
    # The instructions of the first turn are not carried over (as OpenAI).
    assert second.usage.input_tokens == prompt_tokens(server, [
        {"role": "user", "content": "Which city?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tomorrow?"}])


def test_get_delete_cancel_and_tenants(server, client):
    resp = client.responses.create(model="m", input="Hi", max_output_tokens=2,
                                   metadata={"run": "42"})
    assert resp.metadata == {"run": "42"}
    assert client.responses.retrieve(resp.id).model_dump() == resp.model_dump()
    # Another API key is another tenant: the response does not exist for it.
    other = make_client(server, KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model="m", input="x", previous_response_id=resp.id)
    assert error_of(e.value)["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(resp.id)
    # A finished response cannot be cancelled.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(resp.id)
    assert "completed" in error_of(e.value)["message"] or \
        "incomplete" in error_of(e.value)["message"]
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", input="x", previous_response_id=resp.id)
    assert "--max-stored-responses" in error_of(e.value)["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
])
def test_unsupported_fields_are_400_naming_them(client, kwargs, param):
    body = {"model": "m", "input": "Hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert error_of(e.value)["param"] == param


def test_limits_are_the_chat_endpoint_s(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="Hi", max_output_tokens=10**6)
    assert error_of(e.value)["param"] == "max_output_tokens"


class WeatherReport(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


def test_openai_agents_sdk_runs_a_tool_and_answers(server):
    """A whole agent run: the forced call, the tool, the function_call_output sent back in a
    second request, and a final output. The SDK resets tool_choice to auto after a call
    (reset_tool_choice); the final answer is the agent's output_type, i.e. text.format
    json_schema, which a random model can end (a free answer would run to max_tokens, and the
    SDK fails an incomplete response)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran: list[str] = []
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        sent.append({"path": request.url.path, "body": json.loads(request.content)})

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"Sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY_A, max_retries=0,
                                http_client=httpx.AsyncClient(event_hooks={"request": [record]}))
    model = agents.OpenAIResponsesModel(model="m", openai_client=client)
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[get_weather],
                         model=model, output_type=WeatherReport,
                         model_settings=agents.ModelSettings(
                             tool_choice="get_weather", max_tokens=200, temperature=0))
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert ran and ran[0] in ("Paris", "Rome")  # the tool ran, with schema-valid arguments
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert isinstance(result.final_output, WeatherReport)
    assert [r["path"] for r in sent] == ["/v1/responses", "/v1/responses"]
    first, second = (r["body"] for r in sent)
    assert first["tool_choice"] == {"type": "function", "name": "get_weather"}
    (output,) = [i for i in second["input"] if i.get("type") == "function_call_output"]
    (call,) = [i for i in second["input"] if i.get("type") == "function_call"]
    assert output["call_id"] == call["call_id"] and output["output"] == f"Sunny in {ran[0]}."
    assert second["text"]["format"]["type"] == "json_schema"
    assert len(result.raw_responses) == 2
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(response_id: str, text: str = "x") -> StoredResponse:
    return StoredResponse({"id": response_id, "status": "completed"},
                          [{"role": "user", "content": text}])


def test_store_bounds_entries_bytes_ttl_and_tenants():
    clock = FakeClock()
    store = ResponseStore(max_entries=2, max_bytes=10**6, ttl_s=10, clock=clock)
    for name in ("a", "b", "c"):
        assert store.put("t1", record(name))
    assert store.get("t1", "a") is None  # the oldest left for the third
    assert store.get("t1", "b") and store.get("t1", "c")
    assert store.get("t2", "b") is None  # another tenant
    clock.now = 9.0
    assert store.put("t1", record("b"))  # stored again: its age starts over
    clock.now = 10.5
    assert store.get("t1", "c") is None and store.get("t1", "b") is not None
    clock.now = 20.0
    assert store.get("t1", "b") is None and len(store) == 0 and store.num_bytes == 0

    one = record("p", "y" * 100)
    size = len(json.dumps([one.response, one.conversation], separators=(",", ":")))
    by_bytes = ResponseStore(max_entries=100, max_bytes=2 * size + 10, clock=clock)
    for name in ("p", "q", "r"):
        assert by_bytes.put("t", record(name, "y" * 100))
    assert [by_bytes.get("t", n) is not None for n in "pqr"] == [False, True, True]
    assert by_bytes.num_bytes == 2 * size
    assert not by_bytes.put("t", record("big", "z" * 10 * size))  # over the bound alone
    assert by_bytes.get("t", "big") is None and len(by_bytes) == 2
    assert by_bytes.delete("t", "q") and not by_bytes.delete("t", "q")
    assert not ResponseStore(max_entries=0).put("t", record("n"))


def test_one_tenants_traffic_never_evicts_anothers():
    """The bounds hold per API key: a tenant filling its share pushes out only its own."""
    store = ResponseStore(max_entries=2, max_bytes=10**6, ttl_s=10, clock=FakeClock())
    assert store.put("victim", record("keep"))
    for i in range(50):
        assert store.put("noisy", record(f"n{i}"))
    assert store.get("victim", "keep") is not None
    assert len(store) == 3 and store.get("noisy", "n49") and not store.get("noisy", "n0")


def test_a_response_deleted_while_it_runs_is_not_stored_when_it_ends():
    store = ResponseStore()
    running = record("r")
    assert store.put("t", running)
    assert store.delete("t", "r") and running.deleted
    assert store.get("t", "r") is None


def event_type(event) -> str:
    return getattr(event.type, "value", event.type)  # litellm's are an enum of the names


def test_litellm_responses_create_and_stream(server, monkeypatch):
    # Offline here: litellm's bundled model price map, not a download of it.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    route = {"model": "openai/m", "api_base": f"{server.base_url}/v1", "api_key": KEY_A,
             "max_output_tokens": 200, "temperature": 0, "text": JSON_FORMAT}
    resp = litellm.responses(input="Which city?", **route)
    assert resp.id.startswith("resp_") and resp.status == "completed", resp
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    (part,) = message.content
    assert part.type == "output_text"
    jsonschema.validate(json.loads(part.text), CITY_SCHEMA)
    assert resp.usage.input_tokens == prompt_tokens(
        server, [{"role": "user", "content": "Which city?"}])
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens > 0

    events = list(litellm.responses(input="Which city?", stream=True, **route))
    kinds = [event_type(e) for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] == "response.completed", kinds
    final = events[-1].response
    deltas = "".join(e.delta for e in events if event_type(e) == "response.output_text.delta")
    assert final.output[0].content[0].text == deltas
    # The same greedy request, whole or streamed: the same text and token counts.
    assert deltas == part.text
    assert final.usage.output_tokens == resp.usage.output_tokens
    assert final.usage.input_tokens == resp.usage.input_tokens


def test_cancel_stops_a_streamed_response_while_it_runs(server, client):
    # A free answer runs on as reasoning to max_output_tokens (nearly the whole context), far
    # longer than the cancel below takes to land; a cancel that came too late would be a 400.
    budget = 2000
    stream = client.responses.create(model="m", input="Tell me a long story.", stream=True,
                                     max_output_tokens=budget, temperature=0)
    with stream:
        events = [next(stream)]
        assert events[0].type == "response.created"
        response_id = events[0].response.id
        # From a second client (another connection), as a user's "stop" button would.
        cancelled = make_client(server).responses.cancel(response_id)
        assert cancelled.id == response_id and cancelled.status == "cancelled"
        events += list(stream)
    final = check_events(events)
    # OpenAI has no cancelled event: the stream ends with response.incomplete, status cancelled.
    assert events[-1].type == "response.incomplete"
    assert final.status == "cancelled" and final.id == response_id
    assert final.usage.output_tokens < budget
    assert final.usage.output_tokens_details.reasoning_tokens <= final.usage.output_tokens
    assert all(item.status == "incomplete" for item in final.output)
    stored = client.responses.retrieve(response_id)
    assert stored.status == "cancelled"
    assert wire(stored) == wire(final)
    # The engine let go of the request: nothing running or waiting, every KV block back.
    assert wait_until(lambda: drained(server.base_url), timeout_s=60)
    # A cancelled response is finished: a second cancel is refused.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.cancel(response_id)
    assert "cancelled" in error_of(e.value)["message"]
