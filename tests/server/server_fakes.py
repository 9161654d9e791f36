"""A fake engine core (no model, no torch) and a tiny word-level tokenizer, for testing the
transport and AsyncLLM without the real model. The fake core must be importable by module name in
the spawned engine process (pytest puts this directory on sys.path, which spawn passes on)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx

from pagellm.core.sched_output import EngineCoreOutput
from pagellm.metrics.stats import SchedulerStats
from pagellm.request import Request, RequestStatus

VOCAB_SIZE = 50


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB_SIZE)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def make_config(max_model_len: int = 64, step_delay_s: float = 0.002,
                fail_after_steps: int | None = None, fail_at_start: bool = False,
                fail_add_token: int | None = None, step_gate: Any = None):
    """``fail_add_token``: admitting a prompt that holds this token raises in the core;
    ``step_gate``: a multiprocessing (spawn) Event every step waits for."""
    model = SimpleNamespace(max_model_len=max_model_len, vocab_size=VOCAB_SIZE,
                            served_model_name="fake-model", model=None)
    scheduler = SimpleNamespace(max_num_seqs=8, policy="fcfs")
    return SimpleNamespace(model=model, scheduler=scheduler, step_delay_s=step_delay_s,
                           fail_after_steps=fail_after_steps, fail_at_start=fail_at_start,
                           fail_add_token=fail_add_token, step_gate=step_gate,
                           speculative_config=None)


# Each message's content, then a space: the word-level tokenizer reads it back as words.
FAKE_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@contextlib.asynccontextmanager
async def fake_server(tokenizer: Any = None, limits: Any = None, health_max_step_s: float = 0.0,
                      app_kwargs: dict[str, Any] | None = None,
                      **config_kwargs: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """The real app (build_app, its middleware and lifespan) over AsyncLLM and the fake core,
    served in this process through httpx's ASGI transport: (client, engine). Requests run as
    tasks on this event loop, so a handler that blocks the loop blocks the test too.
    ``app_kwargs``: more build_app arguments (they may replace the chat template)."""
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.openai.api_server import build_app

    engine = AsyncLLM(make_config(**config_kwargs), core_factory=FakeEngineCore,
                      tokenizer=tokenizer or make_tokenizer(), eos_token_id=None,
                      log_stats=False)
    app = build_app(engine, **{"chat_template": FAKE_CHAT_TEMPLATE, "limits": limits,
                               "health_max_step_s": health_max_step_s, **(app_kwargs or {})})
    # The unhandled-exception handler answers 500, then re-raises for the server's log.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://pagellm",
                                     timeout=60) as client:
            yield client, engine


def run_fake_server(coro_fn: Any, **server_kwargs: Any) -> Any:
    """``coro_fn(client, engine)``'s result, run against a fresh fake_server(**server_kwargs)."""
    async def main() -> Any:
        async with fake_server(**server_kwargs) as (client, engine):
            return await coro_fn(client, engine)

    return asyncio.run(main())


def next_token(last: int) -> int:
    return (last + 1) % VOCAB_SIZE


class FakeEngineCore:
    """Every running request gets one token per step: the previous token + 1 (mod vocab)."""

    num_blocks = 100

    def __init__(self, config, eos_token_id: int | None) -> None:
        if config.fail_at_start:
            raise ValueError("fake start-up failure: not enough KV cache memory")
        self.config = config
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.aborted: dict[str, RequestStatus] = {}

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:  # as the real scheduler
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler.")
        if self.config.fail_add_token in request.prompt_token_ids:
            raise RuntimeError("fake failure while admitting a request")
        self.requests[request.request_id] = request

    def abort_requests(self, req_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        for req_id in req_ids:
            if self.requests.pop(req_id, None) is not None:
                self.aborted[req_id] = status

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        self.num_steps += 1
        if self.config.step_gate is not None:
            self.config.step_gate.wait()
        if self.config.fail_after_steps is not None and \
                self.num_steps > self.config.fail_after_steps:
            raise RuntimeError("fake model failure")
        time.sleep(self.config.step_delay_s)
        outputs = []
        for req in list(self.requests.values()):
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            token = next_token(req.all_token_ids[-1])
            req.append_output_token_ids([token])
            finish, stop_reason = None, None
            if token in (req.sampling_params.stop_token_ids or ()):
                finish, stop_reason = "stop", token
            elif req.num_output_tokens >= req.max_tokens:
                finish = "length"
            if finish is not None:
                del self.requests[req.request_id]
            outputs.append(EngineCoreOutput(req.request_id, [token], finish, stop_reason))
        return outputs

    def make_stats(self) -> SchedulerStats:
        n = len(self.requests)
        return SchedulerStats(num_running_reqs=n, kv_cache_usage=n / self.num_blocks,
                              num_steps=self.num_steps)

    def reset_prefix_cache(self) -> bool:
        return not self.requests

    def shutdown(self) -> None:
        pass
