"""The Responses API fields of stateless clients (Codex sends them all): ``include`` of
``reasoning.encrypted_content`` (reasoning items carry a value the server reads back from a
later request's input, bound to the API key), ``prompt_cache_key`` (echoed) and
``client_metadata`` (bounded; it goes to the trace span). The server is the shared
tools_server: a random tiny llama whose free answers the deepseek_r1 parser reads as
reasoning."""

from __future__ import annotations

import openai
import pytest
from server_utils import TOOLS_KEY, TOOLS_KEY_B

from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.responses_input import input_messages
from pagellm.entrypoints.openai.responses_sealing import ReasoningSealer
from pagellm.entrypoints.openai.serving_errors import OpenAIError
from pagellm.entrypoints.openai.serving_responses import request_attributes

INCLUDE = ["reasoning.encrypted_content"]


def make_client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0,
                         timeout=120)


def test_sealer_binds_the_text_to_the_tenant_and_the_key():
    sealer = ReasoningSealer()
    value = sealer.seal("tenant-a", "I think, therefore.")
    assert sealer.open("tenant-a", value) == "I think, therefore."
    assert "I think" not in value  # opaque on the wire (base64), though not secret
    assert sealer.open("tenant-b", value) is None  # another tenant's
    assert ReasoningSealer().open("tenant-a", value) is None  # another server start's
    version, text, tag = value.split(".")
    forged = ReasoningSealer().seal("tenant-a", "Other thoughts.").split(".")[1]
    for bad in (f"{version}.{forged}.{tag}", f"{version}.{text}.{tag[:-2]}AA", "x",
                f"pgr0.{text}.{tag}", f"{version}.{text}!.{tag}", ""):
        assert sealer.open("tenant-a", bad) is None, bad


def test_reasoning_items_become_the_next_assistant_turn_s_thinking():
    sealer = ReasoningSealer()
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "summary": [],
              "encrypted_content": sealer.seal("t", "sealed thought")},
             {"type": "reasoning", "summary": [],
              "content": [{"type": "reasoning_text", "text": "plain thought"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "done"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "last"}]}]
    messages = input_messages(items, lambda v: sealer.open("t", v))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["reasoning_content"] == "sealed thought\nplain thought"
    assert messages[1]["tool_calls"][0]["id"] == "c1"
    assert messages[3] == {"role": "assistant", "content": "", "reasoning_content": "last"}
    with pytest.raises(OpenAIError) as e:
        input_messages(items, lambda v: sealer.open("another tenant", v))
    assert e.value.param == "input[1].encrypted_content"


def test_request_fields_are_bounded_and_reach_the_trace_attributes():
    req = ResponsesRequest(input="x", include=INCLUDE, prompt_cache_key="session-1",
                           client_metadata={"session_id": "s", "turn_id": "t"})
    assert req.seals_reasoning
    assert request_attributes(req) == {
        "pagellm.responses.client_metadata.session_id": "s",
        "pagellm.responses.client_metadata.turn_id": "t",
        "pagellm.responses.prompt_cache_key": "session-1"}
    for bad in ({"client_metadata": {"k": "v" * 9000}},
                {"client_metadata": {str(i): "v" for i in range(33)}},
                {"prompt_cache_key": ""}, {"include": ["message.output_text.logprobs"]}):
        with pytest.raises(ValueError):
            ResponsesRequest(input="x", **bad)


def test_encrypted_reasoning_round_trip(tools_server):
    client = make_client(tools_server, TOOLS_KEY)
    question = {"role": "user", "content": "What is the weather?"}
    first = client.responses.create(model="m", input=[question], include=INCLUDE,
                                    store=False, max_output_tokens=8, temperature=0,
                                    prompt_cache_key="session-1",
                                    extra_body={"client_metadata": {"session_id": "s-1"}})
    assert first.prompt_cache_key == "session-1"
    (reasoning,) = first.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    item = reasoning.model_dump(exclude_none=True)
    follow_up = {"role": "user", "content": "And tomorrow?"}
    # Resent (store false: the server kept nothing), it is read back...
    second = client.responses.create(model="m", input=[question, item, follow_up],
                                     include=INCLUDE, store=False, max_output_tokens=2)
    assert second.status in ("completed", "incomplete")
    # Altered, or another API key's: a 400 naming the field.
    value = item["encrypted_content"]
    tampered = {**item, "encrypted_content": value[:-3] + ("AAA" if value[-3:] != "AAA"
                                                             else "BBB")}
    for key, bad in ((TOOLS_KEY, tampered), (TOOLS_KEY_B, item)):
        with pytest.raises(openai.BadRequestError) as e:
            make_client(tools_server, key).responses.create(
                model="m", input=[question, bad, follow_up], max_output_tokens=2)
        error = e.value.response.json()["error"]
        assert error["param"] == "input[1].encrypted_content", error
    # Without include, reasoning items have no encrypted_content.
    plain = client.responses.create(model="m", input=[question], max_output_tokens=4)
    assert plain.output[0].encrypted_content is None and plain.prompt_cache_key is None


def test_streamed_reasoning_item_done_carries_encrypted_content(tools_server):
    client = make_client(tools_server, TOOLS_KEY)
    with client.responses.stream(model="m", input="Tell me something.", include=INCLUDE,
                                 max_output_tokens=6, store=False) as stream:
        events = list(stream)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning"]
    assert added[0].encrypted_content is None and done[0].encrypted_content
    final = events[-1].response
    assert final.output[0].encrypted_content == done[0].encrypted_content
    # The done event's item is the one to resend.
    resent = client.responses.create(
        model="m", input=[{"role": "user", "content": "x"},
                          done[0].model_dump(exclude_none=True)],
        max_output_tokens=1, store=False)
    assert resent.usage.input_tokens > 0


def test_client_metadata_and_prompt_cache_key_reach_the_span():
    otel = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from server_fakes import run_fake_server

    from pagellm.entrypoints.openai.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    provider = otel.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    body = {"input": "w1 w2", "max_output_tokens": 3, "prompt_cache_key": "session-9",
            "client_metadata": {"turn_id": "turn-1"}}

    async def go(client, engine):
        return await client.post("/v1/responses", json=body)

    resp = run_fake_server(go, app_kwargs={"tracer": RequestTracer(provider)})
    assert resp.status_code == 200, resp.text
    assert resp.json()["prompt_cache_key"] == "session-9"
    (span,) = exporter.get_finished_spans()
    attrs = dict(span.attributes)
    assert attrs["pagellm.responses.prompt_cache_key"] == "session-9"
    assert attrs["pagellm.responses.client_metadata.turn_id"] == "turn-1"
