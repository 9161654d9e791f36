"""``pagellm serve [MODEL] [flags]``: every engine flag plus the server's own."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from pagellm.engine.data_parallel import add_multi_node_dp_flags
from pagellm.engine_args import EngineArgs
from pagellm.entrypoints.openai import limits
from pagellm.entrypoints.openai.admin_routes import AdminOptions
from pagellm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagellm.entrypoints.openai.response_store import (
    DEFAULT_MAX_STORED_RESPONSE_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    DEFAULT_STORED_RESPONSE_TTL_S,
    ResponseStore,
)
from pagellm.entrypoints.openai.tenancy import ADMIN_PATHS, PREFIX_CACHE_SCOPES, load_api_keys
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagellm.entrypoints.ports import listen_socket
from pagellm.metrics.metric_specs import DEFAULT_METRIC_NAMES, METRIC_NAMES
from pagellm.structured_output.params import DEFAULT_MAX_WHITESPACE_CNT

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.tracing import RequestTracer

logger = logging.getLogger("pagellm")

API_KEY_ENV = "PAGELLM_API_KEY"
ADMIN_API_KEY_ENV = "PAGELLM_ADMIN_API_KEY"
# Far above any healthy step (a long prefill chunk on a CPU), yet a wedge is seen in minutes.
DEFAULT_HEALTH_MAX_STEP_S = 120.0


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: local only; 0.0.0.0 serves "
                        "the network)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeatable: any of the keys; "
                        f"without --api-key or --api-key-file, env {API_KEY_ENV}); /health, "
                        "/metrics, /version and the API docs stay open")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="accept the keys in PATH: one per line, 'KEY [NAME] [role=admin]' "
                        "(keys with one name are one tenant; role=admin may call the admin "
                        "routes); blank lines and # comments skipped")
    g.add_argument("--admin-api-key", action="append", default=None, metavar="KEY",
                   help="a key with the admin role (repeatable; without it, env "
                        f"{ADMIN_API_KEY_ENV}): only admin keys may call "
                        f"{', '.join(sorted(ADMIN_PATHS))} (403 for tenant keys). A file or "
                        "the environment keeps it out of `ps`")
    g.add_argument("--enable-admin-routes", action="store_true",
                   help="on a server without any API key, serve the admin routes to anyone "
                        "who can reach the port (default: they answer 403)")
    g.add_argument("--allowed-weights-path", default=None, metavar="DIR",
                   help="/update_weights_from_disk loads checkpoint folders under DIR only "
                        "(default: none; the route answers 400)")
    g.add_argument("--prefix-cache-scope", choices=PREFIX_CACHE_SCOPES, default="key",
                   help="key (default): each API key's tenant has its own prefix cache (a "
                        "request's cache_salt narrows it further); global: every request may "
                        "share cached blocks with every other (as vLLM)")
    g.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="report usage.prompt_tokens_details.cached_tokens (off: a hit tells a "
                        "client that someone in its cache namespace sent the same prefix)")
    EngineArgs.add_cli_arg(g, "served_model_name")  # an engine field, spelled as a server flag
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template overriding the tokenizer's: a file, the name of a "
                        "template shipped with pagellm (chatml_tools: ChatML with tools, in "
                        "the hermes format), or the template text itself")
    tools = parser.add_argument_group("tool calling and reasoning (see docs/tool_calling.md)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto", the '
                            "default when a request has tools); needs --tool-call-parser")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls are read from the model's text: hermes "
                            "(<tool_call>{json}</tool_call>: Qwen2.5/Qwen3, Hermes, "
                            "chatml_tools), llama3_json (Llama 3.x JSON calls), mistral "
                            "([TOOL_CALLS])")
    tools.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help='leave the tools out of the chat template when tool_choice is "none"'
                            " (default: the template sees them, as vLLM)")
    tools.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split <think>...</think> into message.reasoning_content: qwen3 "
                            "(when the answer opens with <think>) or deepseek_r1 (everything "
                            "before </think>)")
    store = parser.add_argument_group("/v1/responses store (see docs/serving.md, Responses API)")
    store.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                       help="responses kept for previous_response_id and GET /v1/responses/{id}"
                            ", per tenant (API key; its oldest go first; 0: none)")
    store.add_argument("--max-stored-response-bytes", type=int,
                       default=DEFAULT_MAX_STORED_RESPONSE_BYTES,
                       help="bytes (as JSON) one tenant's stored responses and their "
                            "conversations may hold together; its oldest go first")
    store.add_argument("--stored-response-ttl", type=float,
                       default=DEFAULT_STORED_RESPONSE_TTL_S,
                       help="seconds a stored response is kept")
    g.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="serve GET /tokenizer_info (vLLM's): the tokenizer's configuration and "
                        "chat template, e.g. for lm-evaluation-harness (off: 404)")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="log every request's id, prompt, size and sampling params (without it, "
                        "no prompt text is logged)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: log at most this many prompt characters "
                        "(or token ids) (default: all)")
    g.add_argument("--metrics-names", choices=METRIC_NAMES, default=DEFAULT_METRIC_NAMES,
                   help="/metrics names: vllm (vLLM's vllm:* names and labels, for endpoint "
                        "pickers, KEDA and dashboards written for vLLM), pagellm (the same "
                        "metrics as pagellm:*), or both (default; twice the series)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--health-max-step-seconds", type=float, default=DEFAULT_HEALTH_MAX_STEP_S,
                   metavar="S",
                   help="/health answers 503 once requests have waited S seconds with no engine "
                        f"step completing (a wedged engine) (default {DEFAULT_HEALTH_MAX_STEP_S:g};"
                        " 0 disables)")
    g.add_argument("--structured-outputs-max-whitespace-cnt", type=_max_whitespace_cnt,
                   default=DEFAULT_MAX_WHITESPACE_CNT, metavar="N|none",
                   help="JSON-constrained output (json_schema, json_object, forced tool calls) "
                        "may hold at most N whitespace characters in a row between JSON tokens "
                        f"(default {DEFAULT_MAX_WHITESPACE_CNT}: small models otherwise emit "
                        "whitespace until max_tokens); none: unbounded, as vLLM; a request's "
                        "structured_outputs.max_whitespace_cnt overrides it")
    obs = parser.add_argument_group("tracing and request ids (see docs/serving.md, Tracing)")
    obs.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                     help="export an OpenTelemetry span (llm_request) per request to this OTLP "
                          "collector, a child of the request's traceparent header (needs "
                          "pip install 'pagellm[tracing]'; OTLP over gRPC unless "
                          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf)")
    obs.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction,
                     default=False,
                     help="responses carry X-Request-Id: the request's own X-Request-Id, else "
                          "the id the server gave it")
    obs.add_argument("--enable-per-request-metrics", action=argparse.BooleanOptionalAction,
                     default=False,
                     help="completion responses carry a 'metrics' object with the request's "
                          "queue time, TTFT, decode time, mean ITL and tokens/s (streamed: in "
                          "the usage chunk)")
    lim = parser.add_argument_group("request limits (see docs/reliability.md)")
    lim.add_argument("--max-request-body-bytes", type=int,
                     default=limits.DEFAULT_MAX_REQUEST_BODY_BYTES,
                     help="larger request bodies get 413 (default 8 MiB)")
    lim.add_argument("--max-json-depth", type=int, default=limits.DEFAULT_MAX_JSON_DEPTH,
                     help="JSON bodies nested deeper get 400 (default 32)")
    lim.add_argument("--max-n", type=int, default=limits.DEFAULT_MAX_N,
                     help="largest n (samples per prompt) (default 16)")
    lim.add_argument("--max-stop", type=int, default=limits.DEFAULT_MAX_STOP,
                     help="most stop strings (and stop_token_ids) per request (default 32)")
    lim.add_argument("--max-stop-length", type=int, default=limits.DEFAULT_MAX_STOP_LENGTH,
                     help="longest stop string, in characters (default 256)")
    lim.add_argument("--max-prompts", type=int, default=limits.DEFAULT_MAX_PROMPTS,
                     help="most prompts in one /v1/completions request (default 64)")
    lim.add_argument("--max-seqs-per-request", type=int,
                     default=limits.DEFAULT_MAX_SEQS_PER_REQUEST,
                     help="most sequences (prompts x n) one request may start (default 64)")
    lim.add_argument("--max-logit-bias", type=int, default=limits.DEFAULT_MAX_LOGIT_BIAS,
                     help="most logit_bias entries per request (default 300, as OpenAI)")
    lim.add_argument("--max-prompt-logprobs-entries", type=int,
                     default=limits.DEFAULT_MAX_PROMPT_LOGPROBS_ENTRIES,
                     help="most prompt logprob entries (prompt tokens x (1 + prompt_logprobs), "
                          "summed over the prompts) one request may ask for; echo with "
                          "logprobs counts too (default 65536: about 4 MiB of JSON)")
    lim.add_argument("--max-structured-outputs-spec-bytes", type=int,
                     default=limits.DEFAULT_MAX_STRUCTURED_OUTPUTS_SPEC_BYTES,
                     help="largest structured-output spec (JSON schema, regex, grammar, or "
                          "choices; a forced tool_choice: the tools' parameters), in UTF-8 "
                          "bytes (default 128 KiB)")
    lim.add_argument("--max-structured-outputs-choices", type=int,
                     default=limits.DEFAULT_MAX_STRUCTURED_OUTPUTS_CHOICES,
                     help="most choices (guided_choice), or enum values in all of a JSON "
                          "schema's enums (default 1000, as OpenAI)")
    lim.add_argument("--max-structured-outputs-depth", type=int,
                     default=limits.DEFAULT_MAX_STRUCTURED_OUTPUTS_DEPTH,
                     help="deepest JSON schema, in JSON nesting levels (default 24; OpenAI's 10 "
                          "levels of objects are 21), also for a schema sent as a string")
    lim.add_argument("--max-tools", type=int, default=limits.DEFAULT_MAX_TOOLS,
                     help="most tools per chat request (default 128, as OpenAI)")
    lim.add_argument("--max-bad-words", type=int, default=limits.DEFAULT_MAX_BAD_WORDS,
                     help="most bad_words per request (default 128); each at most "
                          "--max-stop-length characters")
    lim.add_argument("--max-chat-template-kwargs-bytes", type=int,
                     default=limits.DEFAULT_MAX_CHAT_TEMPLATE_KWARGS_BYTES,
                     help="largest chat_template_kwargs, as JSON bytes (default 16384)")
    lim.add_argument("--max-documents", type=int, default=limits.DEFAULT_MAX_DOCUMENTS,
                     help="most chat documents per request (default 64)")
    lim.add_argument("--max-structured-outputs-compiles", type=int,
                     default=limits.DEFAULT_MAX_STRUCTURED_OUTPUTS_COMPILES,
                     help="grammar compiles running or queued in the API server (off the event "
                          "loop); past it, requests with a new spec get 503 with Retry-After "
                          "(default 8)")
    lim.add_argument("--structured-outputs-compile-timeout", type=float,
                     default=limits.DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S, metavar="S",
                     help="a request whose grammar has not compiled after S seconds gets 503 "
                          "with Retry-After; the compile goes on and its grammar is cached for "
                          "the retry (default 10)")
    lim.add_argument("--max-waiting-requests", "--max-queued-requests", type=int, default=None,
                     help="sequences allowed to wait beyond --max-num-seqs; past it new "
                          "requests get 503 with Retry-After (default: "
                          f"{limits.DEFAULT_WAITING_PER_RUNNING_SEQ} x --max-num-seqs; "
                          "--max-queued-requests is SGLang's name for it)")
    lim.add_argument("--max-num-queued-tokens", type=int, default=None,
                     help="while the prompts that have no output token yet hold at least this "
                          "many tokens, new requests get 503 with Retry-After (vLLM's flag; a "
                          "TTFT bound: about target TTFT x prefill tokens/s; default: none)")


def server_limits_from(ns: argparse.Namespace) -> limits.ServerLimits:
    return limits.ServerLimits(
        max_request_body_bytes=ns.max_request_body_bytes, max_json_depth=ns.max_json_depth,
        max_n=ns.max_n, max_stop=ns.max_stop, max_stop_length=ns.max_stop_length,
        max_prompts=ns.max_prompts, max_seqs_per_request=ns.max_seqs_per_request,
        max_logit_bias=ns.max_logit_bias,
        max_prompt_logprobs_entries=ns.max_prompt_logprobs_entries,
        max_structured_outputs_spec_bytes=ns.max_structured_outputs_spec_bytes,
        max_structured_outputs_choices=ns.max_structured_outputs_choices,
        max_structured_outputs_depth=ns.max_structured_outputs_depth, max_tools=ns.max_tools,
        max_bad_words=ns.max_bad_words,
        max_chat_template_kwargs_bytes=ns.max_chat_template_kwargs_bytes,
        max_documents=ns.max_documents,
        max_structured_outputs_compiles=ns.max_structured_outputs_compiles,
        structured_outputs_compile_timeout=ns.structured_outputs_compile_timeout,
        max_waiting_requests=ns.max_waiting_requests,
        max_num_queued_tokens=ns.max_num_queued_tokens,
        structured_outputs_max_whitespace_cnt=ns.structured_outputs_max_whitespace_cnt)


def _max_whitespace_cnt(text: str) -> int | None:
    """--structured-outputs-max-whitespace-cnt: a positive integer, or none (unbounded)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or none, got {text!r}")
    return value


def admin_options_from(ns: argparse.Namespace, keys_configured: bool) -> AdminOptions:
    if ns.enable_admin_routes and keys_configured:
        raise ValueError("--enable-admin-routes is for a server without API keys; with keys, "
                         "give the admin routes' callers --admin-api-key (or role=admin in "
                         "--api-key-file).")
    root = ns.allowed_weights_path
    if root is not None and not os.path.isdir(root):
        raise ValueError(f"--allowed-weights-path {root}: not a directory.")
    return AdminOptions(enable_admin_routes=ns.enable_admin_routes, allowed_weights_path=root)


def request_tracer_from(ns: argparse.Namespace, protocol: str) -> RequestTracer | None:
    """--otlp-traces-endpoint's tracer (``protocol``: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL), or
    None; ValueError names the flag (and the pip command, without the packages)."""
    if ns.otlp_traces_endpoint is None:
        return None
    from pagellm.entrypoints.openai.tracing import RequestTracer, otlp_tracer_provider

    return RequestTracer(otlp_tracer_provider(ns.otlp_traces_endpoint, protocol))


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: SmolLM2-135M-Instruct) with an OpenAI-compatible API: "
                    "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, ...")
    EngineArgs.add_cli_args(parser)
    add_multi_node_dp_flags(parser)  # vLLM's, each refused with the reason
    add_server_args(parser)
    parser.set_defaults(func=run_serve)
    return parser


def _setup_logging() -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    logging.getLogger("pagellm").setLevel(logging.INFO)


def _on_sigterm(signum: int, frame: Any) -> None:
    # Before uvicorn runs (loading) and after it returns, SIGTERM behaves like Ctrl-C, so the
    # finally blocks stop the engine process.
    raise KeyboardInterrupt


def run_serve(ns: argparse.Namespace) -> None:
    """Run the server until SIGINT/SIGTERM; raises SystemExit(1) if the engine dies."""
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.openai.api_server import build_app, serve_http
    from pagellm.entrypoints.openai.chat_tools import ChatToolOptions
    from pagellm.entrypoints.openai.serving_chat import load_chat_template

    _setup_logging()
    signal.signal(signal.SIGTERM, _on_sigterm)
    names = ns.served_model_name
    args = EngineArgs.from_cli_args(ns)  # served_model_name: the first of names
    engine = None
    sock = None
    tracer = None
    exit_code = 0
    try:
        try:
            chat_template = load_chat_template(ns.chat_template)
            tool_options = ChatToolOptions(
                enable_auto_tool_choice=ns.enable_auto_tool_choice,
                tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
                exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none)
            server_limits = server_limits_from(ns)
            config = args.create_engine_config()
            api_keys = load_api_keys(ns.api_key, ns.api_key_file, config.env.api_key,
                                     ns.admin_api_key, config.env.admin_api_key)
            admin = admin_options_from(ns, api_keys is not None)
            tracer = request_tracer_from(ns, config.env.otlp_traces_protocol)
            response_store = ResponseStore(ns.max_stored_responses,
                                           ns.max_stored_response_bytes,
                                           ns.stored_response_ttl)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            # Before the engine loads (as vLLM does): a taken port fails the start at once,
            # and no other process can take the port while the model loads.
            sock = listen_socket(ns.host, ns.port)
        except OSError as e:
            print(f"error: cannot listen on --host {ns.host} --port {ns.port}: "
                  f"{e.strerror or e}", file=sys.stderr)
            raise SystemExit(2) from None
        if api_keys is not None:
            logger.info("%s; prefix cache scope: %s.", api_keys.describe(),
                        ns.prefix_cache_scope)
        engine = AsyncLLM(config, log_stats=not ns.disable_log_stats,
                          log_requests=ns.enable_log_requests, max_log_len=ns.max_log_len,
                          metric_names=ns.metrics_names)
        app = build_app(engine, names, chat_template, api_keys, server_limits,
                        prefix_cache_scope=ns.prefix_cache_scope,
                        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
                        health_max_step_s=ns.health_max_step_seconds,
                        enable_tokenizer_info_endpoint=ns.enable_tokenizer_info_endpoint,
                        tool_options=tool_options, admin=admin, tracer=tracer,
                        enable_request_id_headers=ns.enable_request_id_headers,
                        enable_per_request_metrics=ns.enable_per_request_metrics,
                        response_store=response_store)
        if ns.host not in ("127.0.0.1", "localhost", "::1") and api_keys is None:
            logger.warning("Serving on %s without --api-key: anyone who can reach this port "
                           "can use the model%s.", ns.host,
                           " and the admin routes" if admin.enable_admin_routes else "")
        exit_code = asyncio.run(serve_http(app, engine, sock, log_level=ns.uvicorn_log_level))
    except KeyboardInterrupt:
        logger.info("Interrupted; shutting down.")
    finally:
        if engine is not None:
            engine.shutdown()
        if sock is not None:
            sock.close()
        if tracer is not None:
            tracer.shutdown()  # exports the spans still batched
    if exit_code:
        raise SystemExit(exit_code)


def main(argv: list[str] | None = None) -> None:
    """``python -m pagellm.entrypoints.openai.cli_serve`` == ``pagellm serve``."""
    parser = argparse.ArgumentParser(prog="pagellm")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    ns = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    run_serve(ns)


if __name__ == "__main__":
    main()
