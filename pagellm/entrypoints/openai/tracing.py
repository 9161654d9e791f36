"""OpenTelemetry tracing of requests (``--otlp-traces-endpoint``, as vLLM): one ``llm_request``
span (kind SERVER) per engine request, made when it finishes (nothing runs per token), a child
of the caller's W3C ``traceparent``/``tracestate`` (a new root trace without them), carrying
vLLM's ``gen_ai.*`` attributes.

The OpenTelemetry packages are optional (``pip install 'pagellm[tracing]'``) and imported only
when tracing is asked for: without the flag no code here runs. The tracer provider is an object
handed in (no global provider), so a test can give one with an in-memory exporter.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pagellm
from pagellm.metrics.request_timing import RequestTiming, wall_clock_ns
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
OTLP_PROTOCOLS = ("grpc", "http/protobuf")  # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc: default)
PIP_INSTALL = "pip install 'pagellm[tracing]'"
_TRACER_NAME = "pagellm.entrypoints.openai"


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py): the GenAI semantic conventions' where they have
    one, ``gen_ai.*`` names of vLLM's own for the rest."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def _import(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry packages "
                         f"(opentelemetry-sdk, opentelemetry-exporter-otlp), which are not "
                         f"installed ({e}): {PIP_INSTALL}") from None


def otlp_tracer_provider(endpoint: str, protocol: str = "grpc") -> Any:
    """A TracerProvider that batches spans to the OTLP collector at ``endpoint`` over
    ``protocol`` (grpc, or http/protobuf: then ``endpoint`` is the full URL, e.g.
    http://host:4318/v1/traces). The SDK reads its own OTEL_* settings (OTEL_SERVICE_NAME,
    OTEL_EXPORTER_OTLP_TRACES_INSECURE, headers, ...). ValueError names the flag."""
    if not endpoint:
        raise ValueError("--otlp-traces-endpoint must not be empty.")
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of "
                         f"{', '.join(OTLP_PROTOCOLS)} (for --otlp-traces-endpoint), got "
                         f"{protocol!r}.")
    sdk_trace = _import("opentelemetry.sdk.trace")
    sdk_export = _import("opentelemetry.sdk.trace.export")
    kind = "grpc" if protocol == "grpc" else "http"
    exporter_module = _import(f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter")
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(sdk_export.BatchSpanProcessor(
        exporter_module.OTLPSpanExporter(endpoint=endpoint)))
    return provider


@dataclass(slots=True)
class RequestTrace:
    """One HTTP request's tracing: its tracer and the caller's trace context."""

    tracer: RequestTracer
    context: Any  # an OpenTelemetry Context: the caller's span, or none (a new trace)
    # The endpoint's own span attributes (the Responses API's client_metadata...).
    attributes: dict[str, Any] = field(default_factory=dict)

    def finished(self, output: RequestOutput, params: SamplingParams, model: str,
                 num_prompt_tokens: int, num_completion_tokens: int) -> None:
        """Record the span of one finished engine request (``output``: its last output), with
        the token counts its response reports."""
        self.tracer.record(self.context, output, params, model, num_prompt_tokens,
                           num_completion_tokens, self.attributes)


class RequestTracer:
    """Makes the ``llm_request`` spans, with a tracer from ``tracer_provider`` (an
    OpenTelemetry SDK TracerProvider: otlp_tracer_provider, or a test's)."""

    def __init__(self, tracer_provider: Any) -> None:
        trace = _import("opentelemetry.trace")
        tracecontext = _import("opentelemetry.trace.propagation.tracecontext")
        self.provider = tracer_provider
        self._tracer = tracer_provider.get_tracer(_TRACER_NAME, pagellm.__version__)
        self._propagator = tracecontext.TraceContextTextMapPropagator()
        self._server_kind = trace.SpanKind.SERVER

    def begin(self, headers: Mapping[str, str]) -> RequestTrace:
        """A request's trace, from its headers (``traceparent``/``tracestate``; an invalid
        traceparent counts as none, as W3C Trace Context says)."""
        carrier = {name: headers[name] for name in TRACE_HEADERS if name in headers}
        return RequestTrace(self, self._propagator.extract(carrier))

    def record(self, context: Any, output: RequestOutput, params: SamplingParams, model: str,
               num_prompt_tokens: int, num_completion_tokens: int,
               extra: Mapping[str, Any] | None = None) -> None:
        timing = RequestTiming.of(output.metrics)
        attributes: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: output.request_id,
            SpanAttributes.GEN_AI_RESPONSE_MODEL: model,
            SpanAttributes.GEN_AI_REQUEST_N: params.n,
            SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.GEN_AI_REQUEST_TOP_P: params.top_p,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: num_completion_tokens,
        }
        latencies = {
            SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: timing.time_in_queue,
            SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: timing.time_to_first_token,
            SpanAttributes.GEN_AI_LATENCY_E2E: timing.e2e,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: timing.prefill_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: timing.decode_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: timing.inference_time,
        }
        # A missing timestamp leaves its attribute out (OpenTelemetry has no null).
        attributes.update((k, v) for k, v in latencies.items() if v is not None)
        attributes.update(extra or {})
        end_ns = wall_clock_ns(timing.finished_time) if timing.finished_time is not None \
            else None
        span = self._tracer.start_span(SPAN_NAME, context=context, kind=self._server_kind,
                                       attributes=attributes,
                                       start_time=wall_clock_ns(timing.arrival_time))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Export what is batched, then stop (the server's exit)."""
        self.provider.shutdown()
