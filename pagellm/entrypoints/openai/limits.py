"""Limits on what one HTTP request may ask for (hostile or careless clients), and the ASGI
middleware that enforces the byte-level ones before FastAPI parses anything.

Every limit is a ``pagellm serve`` flag; docs/reliability.md lists them with their defaults.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from pagellm.entrypoints.openai.serving_errors import error_body
from pagellm.structured_output.params import DEFAULT_MAX_WHITESPACE_CNT

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 2**20  # a 128k-token prompt as ids is about 1 MiB
DEFAULT_MAX_JSON_DEPTH = 32  # real requests nest 4 deep; Python's parser recurses per level
DEFAULT_MAX_N = 16
DEFAULT_MAX_STOP = 32
DEFAULT_MAX_STOP_LENGTH = 256  # characters per stop string
DEFAULT_MAX_PROMPTS = 64  # prompts in one /v1/completions batch
DEFAULT_MAX_SEQS_PER_REQUEST = 64  # prompts x n: what one request may start
DEFAULT_MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
# Prompt logprobs: prompt tokens x (1 + top-N) entries, each ~65 bytes of JSON: ~4 MiB. A whole
# 32k-token context scored with logprobs=1 (lm-eval's loglikelihood) fits.
DEFAULT_MAX_PROMPT_LOGPROBS_ENTRIES = 65536
# Structured outputs: what a grammar may be made of (checked before it compiles). A 20k-value
# enum is 320 KB and compiles for seconds to ~70 MiB; real schemas are a few KB.
DEFAULT_MAX_STRUCTURED_OUTPUTS_SPEC_BYTES = 128 * 2**10  # schema, regex, grammar or choices
DEFAULT_MAX_STRUCTURED_OUTPUTS_CHOICES = 1000  # choice entries, or a schema's enum values (OpenAI)
DEFAULT_MAX_STRUCTURED_OUTPUTS_DEPTH = 24  # JSON levels; OpenAI's 10 object levels are 21
DEFAULT_MAX_TOOLS = 128  # as OpenAI
# bad_words: each word is matched against the output's tail at every step, in Python.
DEFAULT_MAX_BAD_WORDS = 128
# chat_template_kwargs as JSON: real ones are a few flags (enable_thinking...).
DEFAULT_MAX_CHAT_TEMPLATE_KWARGS_BYTES = 16 * 2**10
DEFAULT_MAX_DOCUMENTS = 64  # chat documents (RAG templates loop over them)
DEFAULT_MAX_STRUCTURED_OUTPUTS_COMPILES = 8  # compiling or queued in the API server; then 503
DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S = 10.0  # a request's wait for its compile; then 503
# Without --max-waiting-requests, this many times --max-num-seqs may wait: deep enough to keep
# the batch full between a client's requests, small enough that a flood gets 503 quickly.
DEFAULT_WAITING_PER_RUNNING_SEQ = 4


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_n: int = DEFAULT_MAX_N
    max_stop: int = DEFAULT_MAX_STOP
    max_stop_length: int = DEFAULT_MAX_STOP_LENGTH
    max_prompts: int = DEFAULT_MAX_PROMPTS
    max_seqs_per_request: int = DEFAULT_MAX_SEQS_PER_REQUEST
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_prompt_logprobs_entries: int = DEFAULT_MAX_PROMPT_LOGPROBS_ENTRIES
    max_structured_outputs_spec_bytes: int = DEFAULT_MAX_STRUCTURED_OUTPUTS_SPEC_BYTES
    max_structured_outputs_choices: int = DEFAULT_MAX_STRUCTURED_OUTPUTS_CHOICES
    max_structured_outputs_depth: int = DEFAULT_MAX_STRUCTURED_OUTPUTS_DEPTH
    max_tools: int = DEFAULT_MAX_TOOLS
    max_bad_words: int = DEFAULT_MAX_BAD_WORDS
    max_chat_template_kwargs_bytes: int = DEFAULT_MAX_CHAT_TEMPLATE_KWARGS_BYTES
    max_documents: int = DEFAULT_MAX_DOCUMENTS
    max_structured_outputs_compiles: int = DEFAULT_MAX_STRUCTURED_OUTPUTS_COMPILES
    structured_outputs_compile_timeout: float = DEFAULT_STRUCTURED_OUTPUTS_COMPILE_TIMEOUT_S
    # Sequences that may wait beyond --max-num-seqs before new requests get 503;
    # None = DEFAULT_WAITING_PER_RUNNING_SEQ x --max-num-seqs (see waiting_cap).
    max_waiting_requests: int | None = None
    # --max-num-queued-tokens (vLLM's): 503 while the prompts still waiting for their first
    # token hold at least this many tokens; None: no bound.
    max_num_queued_tokens: int | None = None
    # --structured-outputs-max-whitespace-cnt: whitespace a JSON grammar allows in a row, for
    # requests that do not say (structured_outputs.max_whitespace_cnt); None: unbounded.
    structured_outputs_max_whitespace_cnt: int | None = DEFAULT_MAX_WHITESPACE_CNT

    def waiting_cap(self, max_num_seqs: int) -> int:
        if self.max_waiting_requests is not None:
            return self.max_waiting_requests
        return DEFAULT_WAITING_PER_RUNNING_SEQ * max_num_seqs

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_json_depth", "max_n", "max_stop",
                     "max_stop_length", "max_prompts", "max_seqs_per_request",
                     "max_logit_bias", "max_prompt_logprobs_entries",
                     "max_structured_outputs_spec_bytes",
                     "max_structured_outputs_choices", "max_structured_outputs_depth",
                     "max_tools", "max_structured_outputs_compiles", "max_bad_words",
                     "max_chat_template_kwargs_bytes", "max_documents"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}.")
        if not self.structured_outputs_compile_timeout > 0:  # NaN too
            raise ValueError("--structured-outputs-compile-timeout must be > 0, "
                             f"got {self.structured_outputs_compile_timeout}.")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("--max-waiting-requests must be >= 0, "
                             f"got {self.max_waiting_requests}.")
        if self.max_num_queued_tokens is not None and self.max_num_queued_tokens < 1:
            raise ValueError("--max-num-queued-tokens must be >= 1, "
                             f"got {self.max_num_queued_tokens}.")
        cnt = self.structured_outputs_max_whitespace_cnt
        if cnt is not None and cnt < 1:
            raise ValueError("--structured-outputs-max-whitespace-cnt must be >= 1 (or none: "
                             f"unbounded), got {cnt}.")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'"[]{}')
# Quotes and brackets -> their depth step as int8: +1 opens, -1 (0xff) closes, 0 for a quote.
_DEPTH_STEPS = bytes.maketrans(b'"[{]}', b"\x00\x01\x01\xff\xff")
_QUOTE = ord('"')
_SCAN_CHUNK = 1 << 16  # bounds the scan's scratch memory, and lets a deep body stop early


@dataclass(frozen=True)
class JsonScan:
    max_depth: int  # how deep arrays/objects nest (outside strings), up to where it stopped
    work: int  # bytes read, each pass over a buffer counted: at most a fixed multiple of n


def scan_json(body: bytes, stop_above: int | None = None) -> JsonScan:
    """How deep JSON text nests, in a fixed number of single passes over the bytes, so linear
    whatever the body (a backtracking regex over JSON strings was quadratic on an
    unterminated run of ``\\"``). Stops once the depth passes ``stop_above``.

    A JSON tokenizer's states, as whole-buffer passes: *escape*: a backslash takes the next
    byte, so ``\\\\`` pairs are dropped first (left to right, as the parser pairs them), then
    every ``\\"`` left; *in string*: with escapes gone, a byte is inside a string when an odd
    number of quotes precede it; *depth*: the running sum of opening minus closing brackets
    outside strings. Text the JSON parser rejects (a backslash outside a string) can only
    shift what comes after the parser's error, which it never nests into."""
    work = len(body)
    if b"\\" in body:
        body = body.replace(b"\\\\", b"")
        work += len(body)
        body = body.replace(b'\\"', b"")
        work += len(body)
    structural = body.translate(None, _NOT_STRUCTURAL)  # quotes and brackets only
    work += len(body)
    quotes = np.frombuffer(structural, dtype=np.uint8) == _QUOTE
    steps = np.frombuffer(structural.translate(_DEPTH_STEPS), dtype=np.int8)
    work += 2 * len(structural)
    depth = max_depth = in_string = 0
    for start in range(0, len(structural), _SCAN_CHUNK):
        chunk_steps = steps[start:start + _SCAN_CHUNK]
        chunk_quotes = quotes[start:start + _SCAN_CHUNK]
        if chunk_quotes.any():
            # Quote parity; uint8 wraps at 256, which keeps it.
            inside = np.cumsum(chunk_quotes, dtype=np.uint8)
            inside += in_string
            inside &= 1
            in_string = int(inside[-1])
            chunk_steps = chunk_steps * (inside ^ 1).view(np.int8)
            work += 4 * len(chunk_steps)
        elif in_string:
            continue  # all inside one string
        running = np.cumsum(chunk_steps, dtype=np.int32)
        running += depth
        max_depth = max(max_depth, int(running.max()))
        depth = int(running[-1])
        work += 3 * len(chunk_steps)
        if stop_above is not None and max_depth > stop_above:
            break
    return JsonScan(max_depth, work)


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests arrays/objects deeper than ``limit`` (brackets inside strings
    do not count). Linear; a body with at most ``limit`` opening brackets is not scanned."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    return scan_json(body, stop_above=limit).max_depth > limit


def _reject(status: int, message: str, param: str | None, code: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


class RequestLimitsMiddleware:
    """For requests with a body: 413 past ``max_request_body_bytes`` (from Content-Length, or
    while reading a chunked body), 400 for bodies that are not UTF-8 or nest JSON deeper than
    ``max_json_depth``. The checked body is replayed to the app; later ``receive`` calls
    (disconnect detection) go to the client as usual."""

    def __init__(self, app: Any, limits: ServerLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_request_body_bytes
        too_big = _reject(413, f"The request body is larger than {limit} bytes "
                          "(--max-request-body-bytes).", None, "request_too_large")
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await too_big(scope, receive, send)
                    return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await too_big(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        error = self._check(body)
        if error is not None:
            await error(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _check(self, body: bytes) -> JSONResponse | None:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return _reject(400, f"The request body is not valid UTF-8 (byte {e.start}).",
                           None, "invalid_encoding")
        if json_depth_exceeds(body, self.limits.max_json_depth):
            return _reject(400, f"The JSON body nests deeper than {self.limits.max_json_depth} "
                           "levels (--max-json-depth).", None, "json_too_deep")
        if _SURROGATE_ESCAPE.search(body) and has_lone_surrogate(body):
            # "\ud800" alone decodes to a str that no tokenizer or hash can encode.
            return _reject(400, "The request has a string with an unpaired UTF-16 surrogate "
                           "escape (\\ud800-\\udfff).", None, "invalid_encoding")
        return None


def has_lone_surrogate(body: bytes) -> bool:
    """Whether a JSON string (key or value) holds an unpaired surrogate; only called on bodies
    with such an escape, already checked for depth. Unparseable bodies are FastAPI's to
    answer."""
    try:
        value = json.loads(body)
    except ValueError:
        return False
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return False

