"""--otlp-traces-endpoint (one OpenTelemetry ``llm_request`` span per request, a child of the
caller's traceparent), --enable-request-id-headers (X-Request-Id) and
--enable-per-request-metrics (the response's ``metrics`` object), as vLLM has them.

The spans are read back from the OpenTelemetry SDK's own InMemorySpanExporter (the app is served
in this process over the fake engine), and, for the real ``pagellm serve`` flag, from what a
local OTLP/HTTP collector stand-in receives (and an OTLP/gRPC one for the default protocol)."""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import math
import secrets
import sys
import threading
import time
from concurrent import futures

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from server_fakes import run_fake_server
from server_utils import ServerProcess

from pagellm.config import read_env
from pagellm.entrypoints.openai.cli_serve import add_server_args, request_tracer_from
from pagellm.entrypoints.openai.tracing import (
    PIP_INSTALL,
    SPAN_NAME,
    RequestTracer,
    SpanAttributes,
    otlp_tracer_provider,
)

A = SpanAttributes
CHAT = {"messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 6,
        "temperature": 0.5, "top_p": 0.75}
COMPLETION = {"prompt": "w4 w5", "max_tokens": 5, "temperature": 0.25, "top_p": 0.5}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
ALL_ON = {"enable_request_id_headers": True, "enable_per_request_metrics": True}


def memory_tracer() -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider), exporter


def traceparent() -> tuple[str, int, int]:
    """A fresh W3C traceparent header: (header, trace id, parent span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", int(trace_id, 16), int(span_id, 16)


def sse_events(text: str) -> list[dict]:
    datas = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return [json.loads(d) for d in datas[:-1]]


def check_latencies(attrs: dict, client_elapsed_s: float) -> None:
    """The phases fit together, and inside the round trip the client measured."""
    queue, ttft = attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE], attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN]
    prefill = attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL]
    decode = attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE]
    inference = attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE]
    e2e = attrs[A.GEN_AI_LATENCY_E2E]
    assert min(queue, ttft, prefill, decode, inference, e2e) >= 0
    assert math.isclose(queue + prefill, ttft, abs_tol=1e-6)
    assert math.isclose(prefill + decode, inference, abs_tol=1e-6)
    assert ttft <= e2e <= client_elapsed_s
    assert queue + inference <= e2e + 1e-6


def check_span_window(span, wall_before_ns: int, wall_after_ns: int) -> None:
    """Start at arrival, end at finish: inside the client's request, in Unix time (5 ms for
    the monotonic-to-wall conversion)."""
    slack = 5_000_000
    assert wall_before_ns - slack <= span.start_time <= span.end_time <= wall_after_ns + slack
    e2e_ns = span.attributes[A.GEN_AI_LATENCY_E2E] * 1e9
    assert abs((span.end_time - span.start_time) - e2e_ns) <= slack


def check_metrics(metrics: dict, attrs: dict, num_generated: int) -> None:
    """vLLM's response ``metrics`` agree with the span's phases."""
    assert math.isclose(metrics["queue_time_ms"],
                        attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] * 1000, rel_tol=1e-9)
    assert math.isclose(metrics["time_to_first_token_ms"],
                        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] * 1000, rel_tol=1e-9)
    assert math.isclose(metrics["generation_time_ms"],
                        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] * 1000, rel_tol=1e-9)
    assert math.isclose(metrics["mean_itl_ms"],
                        metrics["generation_time_ms"] / (num_generated - 1), rel_tol=1e-9)
    assert math.isclose(metrics["tokens_per_second"],
                        num_generated / attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE],
                        rel_tol=1e-9)


async def timed_post(client: httpx.AsyncClient, path: str, body: dict,
                     headers: dict | None = None) -> tuple[httpx.Response, int, int, float]:
    """(response, wall ns before, wall ns after, monotonic seconds it took)."""
    before, start = time.time_ns(), time.monotonic()
    resp = await client.post(path, json=body, headers=headers or {})
    return resp, before, time.time_ns(), time.monotonic() - start


def test_chat_span_is_a_child_of_the_callers_traceparent():
    tracer, exporter = memory_tracer()
    header, trace_id, parent_id = traceparent()

    async def go(client, engine):
        return await timed_post(client, "/v1/chat/completions", CHAT,
                                {"traceparent": header, "tracestate": "vendor=abc"})

    resp, before, after, elapsed = run_fake_server(
        go, app_kwargs={"tracer": tracer, **ALL_ON})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    (span,) = exporter.get_finished_spans()
    assert span.name == SPAN_NAME == "llm_request" and span.kind is SpanKind.SERVER
    assert span.context.trace_id == trace_id
    assert span.parent is not None and span.parent.is_remote
    assert span.parent.span_id == parent_id and span.parent.trace_id == trace_id
    assert span.context.span_id != parent_id
    assert span.context.trace_state.get("vendor") == "abc"  # tracestate travels along
    attrs = dict(span.attributes)
    assert attrs[A.GEN_AI_REQUEST_ID] == body["id"] == resp.headers["x-request-id"]
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == body["model"]
    assert attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == CHAT["max_tokens"]
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == CHAT["temperature"]
    assert attrs[A.GEN_AI_REQUEST_TOP_P] == CHAT["top_p"]
    assert attrs[A.GEN_AI_REQUEST_N] == 1
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == body["usage"]["prompt_tokens"] == 3
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == body["usage"]["completion_tokens"] == 6
    check_latencies(attrs, elapsed)
    check_span_window(span, before, after)
    check_metrics(body["metrics"], attrs, 6)


def test_streamed_requests_are_traced_and_carry_metrics_in_the_usage_chunk():
    tracer, exporter = memory_tracer()
    chat_header, chat_trace, chat_parent = traceparent()
    cmpl_header, cmpl_trace, cmpl_parent = traceparent()

    async def go(client, engine):
        chat = await timed_post(client, "/v1/chat/completions", {**CHAT, **STREAM},
                                {"traceparent": chat_header})
        cmpl = await timed_post(client, "/v1/completions", {**COMPLETION, **STREAM},
                                {"traceparent": cmpl_header})
        return chat, cmpl

    (chat, _, _, chat_s), (cmpl, _, _, cmpl_s) = run_fake_server(
        go, app_kwargs={"tracer": tracer, **ALL_ON})
    spans = {s.context.trace_id: s for s in exporter.get_finished_spans()}
    assert set(spans) == {chat_trace, cmpl_trace}
    for resp, trace_id, parent, sent, elapsed in (
            (chat, chat_trace, chat_parent, CHAT, chat_s),
            (cmpl, cmpl_trace, cmpl_parent, COMPLETION, cmpl_s)):
        assert resp.status_code == 200, resp.text
        events = sse_events(resp.text)
        last = events[-1]
        usage = last["usage"]
        assert not last["choices"] and usage is not None
        # Only the usage chunk has the metrics, as vLLM sends them.
        assert all("metrics" not in e for e in events[:-1])
        span = spans[trace_id]
        attrs = dict(span.attributes)
        assert span.parent.span_id == parent
        assert attrs[A.GEN_AI_REQUEST_ID] == last["id"] == resp.headers["x-request-id"]
        assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == usage["prompt_tokens"]
        assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == usage["completion_tokens"] \
            == sent["max_tokens"]
        assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == sent["temperature"]
        assert attrs[A.GEN_AI_REQUEST_TOP_P] == sent["top_p"]
        check_latencies(attrs, elapsed)
        check_metrics(last["metrics"], attrs, sent["max_tokens"])


def test_without_traceparent_each_request_is_a_new_root_trace():
    tracer, exporter = memory_tracer()

    async def go(client, engine):
        await client.post("/v1/completions", json=COMPLETION)
        # A malformed traceparent counts as none (W3C Trace Context).
        await client.post("/v1/completions", json=COMPLETION,
                          headers={"traceparent": "00-not-a-trace-01"})

    run_fake_server(go, app_kwargs={"tracer": tracer})
    first, second = exporter.get_finished_spans()
    for span in (first, second):
        assert span.parent is None and span.context.trace_id != 0
    assert first.context.trace_id != second.context.trace_id


def test_several_sequences_trace_each_engine_request_and_null_the_metrics():
    tracer, exporter = memory_tracer()

    async def go(client, engine):
        prompts = await client.post("/v1/completions",
                                    json={**COMPLETION, "prompt": ["w1", "w2 w3 w4"]})
        samples = await client.post("/v1/chat/completions", json={**CHAT, "n": 2})
        return prompts.json(), samples.json()

    prompts, samples = run_fake_server(
        go, app_kwargs={"tracer": tracer, "enable_per_request_metrics": True})
    # Timing of several streams is no one request's: null, as vLLM.
    assert "metrics" in prompts and prompts["metrics"] is None
    assert "metrics" in samples and samples["metrics"] is None
    spans = {s.attributes[A.GEN_AI_REQUEST_ID]: s.attributes
             for s in exporter.get_finished_spans()}
    # Each prompt is an engine request of its own (vLLM's "<id>-<i>").
    assert set(spans) == {f"{prompts['id']}-0", f"{prompts['id']}-1", samples["id"]}
    assert [spans[f"{prompts['id']}-{i}"][A.GEN_AI_USAGE_PROMPT_TOKENS] for i in (0, 1)] \
        == [1, 3]
    assert sum(spans[f"{prompts['id']}-{i}"][A.GEN_AI_USAGE_COMPLETION_TOKENS]
               for i in (0, 1)) == prompts["usage"]["completion_tokens"]
    chat = spans[samples["id"]]
    assert chat[A.GEN_AI_REQUEST_N] == 2
    assert chat[A.GEN_AI_USAGE_COMPLETION_TOKENS] == samples["usage"]["completion_tokens"] \
        == 2 * CHAT["max_tokens"]


def test_flags_off_run_no_tracing_code(monkeypatch):
    """Without --otlp-traces-endpoint nothing touches OpenTelemetry (were it imported, this
    would raise), no response has X-Request-Id or metrics."""
    for name in [m for m in sys.modules if m.split(".")[0] == "opentelemetry"]:
        monkeypatch.setitem(sys.modules, name, None)
    header, _, _ = traceparent()

    async def go(client, engine):
        plain = await client.post("/v1/chat/completions", json=CHAT,
                                  headers={"traceparent": header})
        streamed = await client.post("/v1/completions", json={**COMPLETION, **STREAM},
                                     headers={"traceparent": header})
        return plain, streamed

    plain, streamed = run_fake_server(go)
    assert plain.status_code == streamed.status_code == 200
    assert "x-request-id" not in plain.headers and "x-request-id" not in streamed.headers
    assert "metrics" not in plain.json()
    assert all("metrics" not in e for e in sse_events(streamed.text))


def test_x_request_id_names_the_request_and_comes_back():
    tracer, exporter = memory_tracer()

    async def go(client, engine):
        given = await client.post("/v1/chat/completions", json=CHAT,
                                  headers={"X-Request-Id": "gateway-42"})
        streamed = await client.post("/v1/completions", json={**COMPLETION, **STREAM},
                                     headers={"X-Request-Id": "gateway-43"})
        generated = await client.post("/v1/completions", json=COMPLETION)
        models = await client.get("/v1/models")
        too_long = await client.post("/v1/completions", json=COMPLETION,
                                     headers={"X-Request-Id": "x" * 257})
        spaced = await client.post("/v1/completions", json=COMPLETION,
                                   headers={"X-Request-Id": "a b"})
        return given, streamed, generated, models, too_long, spaced

    given, streamed, generated, models, too_long, spaced = run_fake_server(
        go, app_kwargs={"tracer": tracer, "enable_request_id_headers": True})
    # The client's id is echoed, and names the request (vLLM's "<prefix>-<X-Request-Id>").
    assert given.headers["x-request-id"] == "gateway-42"
    assert given.json()["id"] == "chatcmpl-gateway-42"
    assert streamed.headers["x-request-id"] == "gateway-43"
    assert {e["id"] for e in sse_events(streamed.text)} == {"cmpl-gateway-43"}
    # Without one, the header is the id the server generated.
    assert generated.headers["x-request-id"] == generated.json()["id"]
    assert generated.json()["id"].startswith("cmpl-")
    assert len(models.headers["x-request-id"]) == 32  # any other route: a fresh one
    for bad in (too_long, spaced):
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "X-Request-Id"
        assert "X-Request-Id" in bad.json()["error"]["message"]
        assert len(bad.headers["x-request-id"]) == 32  # the invalid one is not echoed
    ids = sorted(s.attributes[A.GEN_AI_REQUEST_ID] for s in exporter.get_finished_spans())
    assert ids == sorted(["chatcmpl-gateway-42", "cmpl-gateway-43", generated.json()["id"]])


def test_refusals_before_the_route_carry_the_header():
    """The header is added outside the API key check and the body limits."""
    async def go(client, engine):
        no_key = await client.post("/v1/completions", json=COMPLETION,
                                   headers={"X-Request-Id": "who-1"})
        keyed = await client.post("/v1/completions", json=COMPLETION, headers={
            "X-Request-Id": "who-2", "Authorization": "Bearer k"})
        return no_key, keyed

    no_key, keyed = run_fake_server(go, app_kwargs={"api_key": "k",
                                                    "enable_request_id_headers": True})
    assert no_key.status_code == 401 and no_key.headers["x-request-id"] == "who-1"
    assert keyed.status_code == 200 and keyed.headers["x-request-id"] == "who-2"
    assert keyed.json()["id"] == "cmpl-who-2"


def test_x_request_ids_in_flight_together_are_both_served():
    """Two requests may carry the same X-Request-Id (two tenants' clients may pick the same
    one): both are served, both answer with the client's id, and neither learns the other is
    in flight; the engine runs them under distinct ids."""
    long_request = {**COMPLETION, "max_tokens": 30}
    seen: list[str] = []

    async def go(client, engine):
        add_request = engine.add_request

        def spy(request_id, *args, **kwargs):
            seen.append(request_id)
            return add_request(request_id, *args, **kwargs)

        engine.add_request = spy
        headers = {"X-Request-Id": "same"}
        return await asyncio.gather(
            client.post("/v1/completions", json=long_request, headers=headers),
            client.post("/v1/completions", json=long_request, headers=headers))

    first, second = run_fake_server(go, step_delay_s=0.02)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json()["id"] == second.json()["id"] == "cmpl-same"
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    engine_ids = [rid for rid in seen if rid.startswith("cmpl-same")]
    assert "cmpl-same" in engine_ids and len(set(engine_ids)) == 2, seen


def test_missing_packages_and_bad_protocol_name_the_flag(monkeypatch):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    ns = parser.parse_args(["--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    assert request_tracer_from(parser.parse_args([]), "grpc") is None
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        request_tracer_from(ns, "http/json")
    assert read_env({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
                    ).otlp_traces_protocol == "http/protobuf"
    assert read_env({}).otlp_traces_protocol == "grpc"
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ValueError) as err:
        request_tracer_from(ns, "grpc")
    assert "--otlp-traces-endpoint" in str(err.value) and PIP_INSTALL in str(err.value)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def exported_spans(requests: list) -> list:
    return [span for req in requests for rs in req.resource_spans for ss in rs.scope_spans
            for span in ss.spans]


def proto_attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_default_grpc_exporter_reaches_an_otlp_collector():
    """The default protocol (grpc, as vLLM): the OTLP exporter delivers the span to a local
    OTLP/gRPC collector stand-in."""
    import grpc

    service = _TraceService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    header, trace_id, parent_id = traceparent()
    tracer = RequestTracer(otlp_tracer_provider(f"http://127.0.0.1:{port}", "grpc"))
    try:
        async def go(client, engine):
            return (await client.post("/v1/completions", json=COMPLETION,
                                      headers={"traceparent": header})).json()

        body = run_fake_server(go, app_kwargs={"tracer": tracer})
        assert tracer.provider.force_flush(30_000)
    finally:
        tracer.shutdown()
        server.stop(None)
    (span,) = exported_spans(service.requests)
    assert span.name == SPAN_NAME and span.kind == span.SPAN_KIND_SERVER
    assert int.from_bytes(span.trace_id, "big") == trace_id
    assert int.from_bytes(span.parent_span_id, "big") == parent_id
    attrs = proto_attributes(span)
    assert attrs[A.GEN_AI_REQUEST_ID] == body["id"]
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == body["usage"]["completion_tokens"]


class _OtlpHttpCollector(http.server.ThreadingHTTPServer):
    """POST /v1/traces: keeps each ExportTraceServiceRequest, answers as a collector does."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                data = self.rfile.read(int(self.headers["Content-Length"]))
                collector.paths.append(self.path)
                collector.requests.append(
                    trace_service_pb2.ExportTraceServiceRequest.FromString(data))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def test_pagellm_serve_flags_export_over_otlp_http(tmp_path, make_tiny_model):
    """The real CLI: ``pagellm serve --otlp-traces-endpoint`` (OTLP/HTTP, by the environment
    variable vLLM reads) with --enable-request-id-headers and --enable-per-request-metrics, over
    a tiny model; the spans reach the collector when the server stops."""
    collector = _OtlpHttpCollector()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    model = make_tiny_model(tmp_path / "model", "llama")
    srv = ServerProcess([str(model), "--dtype", "float32", "--max-model-len", "256",
                         "--kv-cache-memory", "8MiB", "--otlp-traces-endpoint", endpoint,
                         "--enable-request-id-headers", "--enable-per-request-metrics"],
                        tmp_path / "server.log",
                        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    header, trace_id, parent_id = traceparent()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as client:
            chat = client.post("/v1/chat/completions", headers={
                "traceparent": header, "X-Request-Id": "cli-1"}, json={
                "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True})
            streamed = client.post("/v1/completions", json={
                "prompt": "hello there", "max_tokens": 3, "ignore_eos": True, **STREAM})
    finally:
        assert srv.stop() == 0, srv.log()
        collector.shutdown()
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert chat.headers["x-request-id"] == "cli-1" and body["id"] == "chatcmpl-cli-1"
    assert set(body["metrics"]) == {"time_to_first_token_ms", "generation_time_ms",
                                    "queue_time_ms", "mean_itl_ms", "tokens_per_second"}
    last = sse_events(streamed.text)[-1]
    assert streamed.headers["x-request-id"] == last["id"] and last["metrics"] is not None
    assert set(collector.paths) == {"/v1/traces"}
    spans = {proto_attributes(s)[A.GEN_AI_REQUEST_ID]: s
             for s in exported_spans(collector.requests)}
    assert set(spans) == {"chatcmpl-cli-1", last["id"]}
    span = spans["chatcmpl-cli-1"]
    assert span.name == SPAN_NAME and span.kind == span.SPAN_KIND_SERVER
    assert int.from_bytes(span.trace_id, "big") == trace_id
    assert int.from_bytes(span.parent_span_id, "big") == parent_id
    attrs = proto_attributes(span)
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == body["usage"]["prompt_tokens"]
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == body["usage"]["completion_tokens"] == 4
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == 0.0
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == body["model"]
    assert not spans[last["id"]].parent_span_id  # no traceparent: a root span
