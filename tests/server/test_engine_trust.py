"""The engine process survives a request it cannot admit, request ids never collide with n > 1
sample ids, and /health tells a wedged engine (a step that never completes) from a healthy one.
Fake engine core (server_fakes.py): no model."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import pytest
from server_fakes import FakeEngineCore, fake_server, make_config, make_tokenizer

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.cli_serve import DEFAULT_HEALTH_MAX_STEP_S, add_serve_parser
from pagellm.sampling_params import SamplingParams

COMPLETIONS = "/v1/completions"
FAIL_ADD = 9  # the fake core raises while admitting a prompt with this token


def body(prompt: list[int], **fields) -> dict:
    return {"prompt": prompt, "max_tokens": 3, "temperature": 0, **fields}


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_sample_id_collision_is_refused_and_the_engine_goes_on():
    """``n=2`` names its samples ``0_<id>`` and ``1_<id>``: a request with either id (or a
    later n=2 request whose sample ids are taken) is refused in the front end instead of
    reaching the engine core, whose scheduler would raise on the duplicate."""
    async def main():
        engine = AsyncLLM(make_config(), core_factory=FakeEngineCore,
                          tokenizer=make_tokenizer(), eos_token_id=None, log_stats=False)
        try:
            first = engine.add_request("x", {"prompt_token_ids": [3, 4]},
                                       SamplingParams(n=2, max_tokens=20))
            single = engine.add_request("0_y", {"prompt_token_ids": [5]},
                                        SamplingParams(max_tokens=20))
            for rid, n in (("0_x", 1), ("1_x", 1), ("x", 1), ("y", 2)):
                with pytest.raises(ValueError, match="already in use"):
                    engine.add_request(rid, {"prompt_token_ids": [5]},
                                       SamplingParams(n=n, max_tokens=2))
            reasons = {c.index: c.finish_reason async for o in first for c in o.outputs
                       if c.finish_reason is not None}
            assert reasons == {0: "length", 1: "length"}
            assert [o async for o in single][-1].outputs[0].finish_reason == "length"
            assert not engine.errored and engine.num_unfinished_requests == 0
        finally:
            await engine.aclose()

    asyncio.run(main())


def test_a_request_the_engine_cannot_admit_fails_alone():
    async def main():
        async with fake_server(fail_add_token=FAIL_ADD) as (client, engine):
            long = asyncio.create_task(client.post(COMPLETIONS, json=body([3], max_tokens=40)))
            bad = await client.post(COMPLETIONS, json=body([FAIL_ADD, 3], n=2))
            assert bad.status_code == 500, bad.text
            err = bad.json()["error"]
            assert err["code"] == "internal_server_error"
            assert "while admitting" in err["message"] and "server log" in err["message"]
            assert "fake failure" not in err["message"]  # the cause stays in the log
            ok = await long
            assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
            assert (await client.post(COMPLETIONS, json=body([4]))).status_code == 200
            assert (await client.get("/health")).status_code == 200
            assert not engine.errored and engine.num_unfinished_requests == 0

    asyncio.run(main())


def test_health_flag_default_and_off():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["serve", "m"])
    assert ns.health_max_step_seconds == DEFAULT_HEALTH_MAX_STEP_S == 120.0
    assert parser.parse_args(["serve", "m", "--health-max-step-seconds", "0"]
                             ).health_max_step_seconds == 0.0


@pytest.mark.parametrize("limit_s", [0.05, 0.0])
def test_health_503_while_a_step_hangs_then_200(limit_s):
    """The fake core's step waits on an Event: with requests in flight and no step completing
    for longer than the limit, /health answers 503 and says why; an idle engine is healthy
    however long ago its last step was; 0 turns the check off."""
    gate = multiprocessing.get_context("spawn").Event()

    async def main():
        async with fake_server(health_max_step_s=limit_s, step_gate=gate) as (client, engine):
            try:
                await asyncio.sleep(2 * limit_s)  # idle past the limit: no step is owed
                idle = await client.get("/health")
                assert idle.status_code == 200 and idle.content == b""
                pending = asyncio.create_task(client.post(COMPLETIONS, json=body([3])))

                async def in_flight() -> bool:
                    return engine.num_unfinished_requests > 0

                await wait_for(in_flight)
                if limit_s:
                    async def unhealthy() -> bool:
                        return (await client.get("/health")).status_code == 503

                    await wait_for(unhealthy)
                    err = (await client.get("/health")).json()["error"]
                    assert err["code"] == "engine_stalled" and err["type"] == "server_error"
                    assert "--health-max-step-seconds" in err["message"]
                else:
                    await asyncio.sleep(0.1)
                    assert (await client.get("/health")).status_code == 200
                gate.set()  # the step completes: the request finishes, healthy again
                assert (await pending).status_code == 200
                assert (await client.get("/health")).status_code == 200
            finally:
                gate.set()  # never leave the engine process blocked

    asyncio.run(main())
