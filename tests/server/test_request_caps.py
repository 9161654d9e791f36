"""Finite default limits (docs/reliability.md): a bounded waiting queue scaled by --max-num-seqs,
a cap on the sequences one request starts, and a 300-entry logit_bias cap with OpenAI's value
range. Each answers a 4xx/503 naming its field; requests within the limits are unchanged."""

from __future__ import annotations

import argparse
import asyncio

from server_fakes import run_fake_server as run

from pagellm.entrypoints.openai import limits
from pagellm.entrypoints.openai.cli_serve import add_serve_parser, server_limits_from

COMPLETIONS = "/v1/completions"


def body(**fields) -> dict:
    return {"prompt": "w1 w2", "max_tokens": 2, "temperature": 0, **fields}


def assert_error(resp, status: int, param: str | None, needle: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert needle in err["message"], err


def test_cli_defaults_are_finite():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    lim = server_limits_from(parser.parse_args(["serve", "some-model"]))
    assert lim.max_seqs_per_request == 64 and lim.max_logit_bias == 300
    assert lim.waiting_cap(8) == limits.DEFAULT_WAITING_PER_RUNNING_SEQ * 8 == 32
    ns = parser.parse_args(["serve", "m", "--max-seqs-per-request", "5", "--max-logit-bias",
                            "7", "--max-waiting-requests", "0"])
    lim = server_limits_from(ns)
    assert (lim.max_seqs_per_request, lim.max_logit_bias, lim.waiting_cap(8)) == (5, 7, 0)


def test_logit_bias_entries_and_values():
    async def send(client, engine):
        # Ids the front end's vocabulary check would pass: the count is refused first.
        engine.config.model.vocab_size = 1000
        too_many = {str(i): 1.0 for i in range(301)}
        at_cap = {str(i): 1.0 for i in range(40)}  # the fake engine's vocabulary is 50
        return [await client.post(COMPLETIONS, json=body(logit_bias=too_many)),
                await client.post(COMPLETIONS, json=body(logit_bias=at_cap)),
                await client.post(COMPLETIONS, json=body(logit_bias={"1": 100.5})),
                await client.post(COMPLETIONS, json=body(logit_bias={"1": -101})),
                await client.post(COMPLETIONS, json=body(logit_bias={"1": -100, "2": 100}))]

    many, at_cap, high, low, edge = run(send)
    assert_error(many, 400, "logit_bias", "--max-logit-bias")
    assert "301" in many.json()["error"]["message"]
    assert at_cap.status_code == 200, at_cap.text
    assert_error(high, 400, "logit_bias", "[-100, 100]")
    assert_error(low, 400, "logit_bias", "[-100, 100]")
    assert edge.status_code == 200, edge.text


def test_sequences_per_request():
    async def send(client, engine):
        engine.config.scheduler.max_num_seqs = 16  # 16 + 4 x 16 waiting: room for 64
        return [await client.post(COMPLETIONS, json=body(prompt=["w1"] * 5, n=13)),
                await client.post(COMPLETIONS, json=body(prompt=["w1"] * 4, n=16))]

    over, at_cap = run(send)
    assert_error(over, 400, "n", "--max-seqs-per-request")
    assert "65" in over.json()["error"]["message"]
    assert at_cap.status_code == 200, at_cap.text
    assert len(at_cap.json()["choices"]) == 64


def test_waiting_queue_bounded_by_default():
    # The fake runs 8 sequences; by default 4 x 8 more may wait: 40 in all, so of three
    # requests of 16 slow sequences the last one admitted is refused with 503.
    async def send(client, engine):
        slow = body(prompt="w1", n=16, max_tokens=40, ignore_eos=True)
        return await asyncio.gather(*(client.post(COMPLETIONS, json=slow) for _ in range(3)))

    responses = run(send, step_delay_s=0.05)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 503], [r.text for r in responses]
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.headers["Retry-After"]
    assert refused.json()["error"]["code"] == "server_overloaded"
