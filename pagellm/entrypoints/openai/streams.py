"""Stream helpers of the serving classes: merge and drain request streams (aborting what is
left), and write server-sent events (data, the error event, ``[DONE]``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel

from pagellm.engine.async_llm import EngineDeadError, RequestFailedError, RequestStream
from pagellm.entrypoints.openai.protocol import StreamOptions
from pagellm.entrypoints.openai.serving_errors import (
    OpenAIError,
    describe_error,
    error_body,
    internal_error,
)
from pagellm.errors import EngineSleepingError
from pagellm.outputs import RequestOutput


def stream_usage_modes(options: StreamOptions | None) -> tuple[bool, bool]:
    """(usage on every chunk, a final usage chunk) for a stream's ``stream_options``.
    continuous_usage_stats alone is enough for the first (vLLM also wants include_usage:
    a client that asks for usage on every chunk gets it either way)."""
    if options is None:
        return False, False
    return options.continuous_usage_stats, options.include_usage


def close_all(streams: Sequence[RequestStream]) -> None:
    """Abort whatever has not finished (a no-op for finished streams)."""
    for s in streams:
        s.close()


async def final_outputs(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The last output of each stream (FINAL_ONLY streams yield exactly one)."""

    async def last(stream: RequestStream) -> RequestOutput:
        last_out = None
        async for out in stream:
            last_out = out
        assert last_out is not None and last_out.finished
        return last_out

    try:
        return list(await asyncio.gather(*(last(s) for s in streams)))
    finally:
        close_all(streams)


async def merge_streams(streams: Sequence[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index. Leaving early
    (cancellation, client gone) aborts every unfinished stream."""
    pending: dict[asyncio.Future, int] = {}
    try:
        for i, s in enumerate(streams):
            pending[asyncio.ensure_future(s.__anext__())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
    finally:
        for fut in pending:
            fut.cancel()
        close_all(streams)


def sse(data: BaseModel | dict[str, Any] | str) -> str:
    if isinstance(data, BaseModel):
        payload = data.model_dump_json(exclude_unset=False)
    elif isinstance(data, dict):
        payload = json.dumps(data)
    else:
        payload = data
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException, request_id: str | None = None) -> str:
    """The error event of a stream whose headers are sent (then comes ``[DONE]``)."""
    if not isinstance(exc, OpenAIError | RequestFailedError | EngineDeadError
                      | EngineSleepingError):
        exc = internal_error(exc, request_id, "a stream")
    status, message, code = describe_error(exc)
    return sse(error_body(status, message, code=code))


SSE_DONE = "data: [DONE]\n\n"
