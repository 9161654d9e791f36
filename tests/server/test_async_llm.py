"""AsyncLLM + the engine-core process, with a fake core (no model): transport, streaming, n > 1,
stop strings, aborts on cancellation, metrics, and engine death."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from server_fakes import FakeEngineCore, make_config, make_tokenizer, next_token

from pagellm.engine.async_llm import AsyncLLM, EngineDeadError, OutputKind
from pagellm.sampling_params import SamplingParams

TOKENIZER = make_tokenizer()


def run_with_engine(body, **config_kwargs):
    async def main():
        engine = AsyncLLM(make_config(**config_kwargs), core_factory=FakeEngineCore,
                          tokenizer=TOKENIZER, eos_token_id=None, log_stats=False)
        try:
            return await body(engine)
        finally:
            await engine.aclose()
            assert not engine.core.proc.is_alive()
            assert not os.path.exists(engine.core._tmpdir)

    return asyncio.run(main())


def expected_tokens(prompt_ids: list[int], n: int) -> list[int]:
    out, last = [], prompt_ids[-1]
    for _ in range(n):
        last = next_token(last)
        out.append(last)
    return out


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_stream_deltas_n_and_final_only():
    async def body(engine):
        prompt = {"prompt_token_ids": [3, 4]}
        deltas = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=5), "a")]
        ids = [t for o in deltas for t in o.outputs[0].token_ids]
        assert ids == expected_tokens([3, 4], 5) == [5, 6, 7, 8, 9]
        # The text continues the prompt (hence the leading space).
        assert "".join(o.outputs[0].text for o in deltas) == \
            TOKENIZER.decode([3, 4] + ids)[len(TOKENIZER.decode([3, 4])):] == " w5 w6 w7 w8 w9"
        assert [o.finished for o in deltas] == [False] * 4 + [True]
        assert deltas[-1].outputs[0].finish_reason == "length"

        # n = 2: children have their own ids in the engine, the parent id outside.
        finals = [o async for o in engine.generate(
            "w10", SamplingParams(max_tokens=3, n=2), "b", kind=OutputKind.FINAL_ONLY)]
        assert len(finals) == 1 and finals[0].request_id == "b" and finals[0].finished
        assert [c.index for c in finals[0].outputs] == [0, 1]
        for c in finals[0].outputs:
            assert c.token_ids == [11, 12, 13] and c.text == " w11 w12 w13"
        # Every prompt's first token counted once per sample: 2 + 1 + 1 prompt tokens.
        await wait_for(lambda: engine.scheduler_stats.num_running_reqs == 0)
        assert engine.prometheus.prompt_tokens._value.get() == 4
        assert engine.prometheus.generation_tokens._value.get() == 11
        assert engine.prometheus.success["length"]._value.get() == 3
        assert engine.prometheus.ttft._sum.get() > 0

    run_with_engine(body)


def test_bad_prompts_raise_before_reaching_the_engine():
    async def body(engine):
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("x", {"prompt_token_ids": []}, SamplingParams())
        with pytest.raises(ValueError, match="out of vocabulary"):
            engine.add_request("x", {"prompt_token_ids": [1, 99]}, SamplingParams())
        with pytest.raises(ValueError, match="70 tokens.*64"):
            engine.add_request("x", {"prompt_token_ids": [1] * 70}, SamplingParams())
        # max_tokens past the context is clamped: 60 prompt + 4 = 64.
        out = [o async for o in engine.generate({"prompt_token_ids": [1] * 60},
                                                SamplingParams(max_tokens=100), "y")]
        assert sum(len(o.outputs[0].token_ids) for o in out) == 4
        assert not engine.output_processor.requests

    run_with_engine(body)


def test_stop_string_stops_the_engine_request():
    async def body(engine):
        params = SamplingParams(max_tokens=2000, stop=["w9"])
        outs = [o async for o in engine.generate({"prompt_token_ids": [5]}, params, "s")]
        text = "".join(o.outputs[0].text for o in outs)
        assert outs[-1].outputs[0].finish_reason == "stop"
        assert outs[-1].outputs[0].stop_reason == "w9"
        assert text.strip() == "w6 w7 w8"
        # Without the front end's abort the fake core would run 2000 steps (> 4 s).
        await wait_for(lambda: engine.scheduler_stats.num_running_reqs == 0, timeout_s=2.0)
        assert engine.prometheus.success["stop"]._value.get() == 1

    run_with_engine(body)


def test_cancelled_consumers_abort_their_requests():
    async def consume(engine, i, got_two):
        n = 0
        async for _ in engine.generate({"prompt_token_ids": [i + 1]},
                                       SamplingParams(max_tokens=2000), f"r{i}"):
            n += 1
            if n == 2:
                got_two.release()

    async def body(engine):
        got_two = asyncio.Semaphore(0)
        tasks = [asyncio.create_task(consume(engine, i, got_two)) for i in range(8)]
        for _ in tasks:
            await got_two.acquire()
        assert engine.scheduler_stats.num_running_reqs > 0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for(lambda: engine.scheduler_stats.num_running_reqs == 0, timeout_s=2.0)
        assert engine.scheduler_stats.kv_cache_usage == 0.0
        assert engine.prometheus.running._value.get() == 0
        assert engine.prometheus.success["abort"]._value.get() == 8
        assert not engine.output_processor.requests and len(engine.request_stats) == 0
        # A new request still completes.
        outs = [o async for o in engine.generate("w1", SamplingParams(max_tokens=3), "after")]
        assert outs[-1].finished
        assert await engine.reset_prefix_cache() is True

    run_with_engine(body, step_delay_s=0.005)


def test_dropped_stream_is_aborted():
    async def body(engine):
        stream = engine.add_request("dropped", "w1", SamplingParams(max_tokens=2000))
        await stream.__anext__()
        del stream  # never closed explicitly: __del__ aborts it
        await wait_for(lambda: engine.scheduler_stats.num_running_reqs == 0, timeout_s=2.0)

    run_with_engine(body)


def test_engine_failure_fails_requests_and_reports_dead():
    async def body(engine):
        dead = []
        engine.on_dead(dead.append)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("w1", SamplingParams(max_tokens=100), "z"):
                pass
        await wait_for(lambda: bool(dead))
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            engine.add_request("later", "w1", SamplingParams())

    run_with_engine(body, fail_after_steps=3)


def test_killed_engine_process_is_noticed():
    async def body(engine):
        dead = []
        engine.on_dead(dead.append)
        stream = engine.add_request("k", "w1", SamplingParams(max_tokens=5000))
        await stream.__anext__()
        os.kill(engine.engine_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exit code -9"):
            async for _ in stream:
                pass
        assert dead and engine.errored

    run_with_engine(body)


def test_start_failure_reports_the_reason():
    with pytest.raises(RuntimeError, match="not enough KV cache memory"):
        AsyncLLM(make_config(fail_at_start=True), core_factory=FakeEngineCore,
                 tokenizer=TOKENIZER, log_stats=False)
