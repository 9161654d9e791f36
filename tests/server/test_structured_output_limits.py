"""Structured outputs against a hostile client, on the real app in this process (fake engine
core, real xgrammar compiles in the API process): the caps on a spec are 400s naming the field
before anything compiles; a compile runs off the event loop, bounded (503 when full) and with a
time limit (503); the compiled-grammar cache is per API-key tenant."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest
from server_fakes import run_fake_server as run

from pagellm.entrypoints.openai.cli_serve import add_serve_parser, server_limits_from
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.tenancy import ApiKey, ApiKeys

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Compiles for about 2 s with the fake 50-word vocabulary (xgrammar 0.2.9, this CPU): long
# enough that a compile on the event loop shows as a gap in a 10 ms ticker.
SLOW_SCHEMA = {"type": "object", "required": ["x"],
               "properties": {"x": {"enum": [f"value-{i:06d}" for i in range(20_000)]}}}
# Caps that let SLOW_SCHEMA through (it is past the defaults).
ROOMY = {"max_structured_outputs_spec_bytes": 2**20, "max_structured_outputs_choices": 50_000}


def completion(**fields) -> dict:
    return {"prompt": "w1 w2", "max_tokens": 2, "temperature": 0, **fields}


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2, **fields}


def enum_schema(n: int, props: int = 1) -> dict:
    """``props`` properties, each an enum, ``n`` values in all."""
    per = n // props
    return {"type": "object", "properties": {
        f"p{j}": {"enum": [f"v{j}-{i}" for i in range(per)]} for j in range(props)}}


def nested(depth: int) -> dict:
    """A schema nesting ``depth`` (odd) JSON levels deep: objects in "properties", two levels
    each."""
    schema: dict = {"type": "integer"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def assert_error(resp, status: int, param: str | None, needle: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert needle in err["message"], err
    return err


def test_flags_defaults_and_validation():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    lim = server_limits_from(parser.parse_args(["serve", "m"]))
    assert lim.max_structured_outputs_spec_bytes == 128 * 2**10
    assert lim.max_structured_outputs_choices == 1000
    assert lim.max_structured_outputs_depth == 24
    assert lim.max_tools == 128
    assert lim.max_structured_outputs_compiles == 8
    assert lim.structured_outputs_compile_timeout == 10.0
    lim = server_limits_from(parser.parse_args([
        "serve", "m", "--max-structured-outputs-spec-bytes", "10",
        "--max-structured-outputs-choices", "11", "--max-structured-outputs-depth", "12",
        "--max-tools", "13", "--max-structured-outputs-compiles", "14",
        "--structured-outputs-compile-timeout", "1.5"]))
    assert (lim.max_structured_outputs_spec_bytes, lim.max_structured_outputs_choices,
            lim.max_structured_outputs_depth, lim.max_tools, lim.max_structured_outputs_compiles,
            lim.structured_outputs_compile_timeout) == (10, 11, 12, 13, 14, 1.5)
    with pytest.raises(ValueError, match="--max-tools must be >= 1"):
        ServerLimits(max_tools=0)
    with pytest.raises(ValueError, match="--max-structured-outputs-compiles must be >= 1"):
        ServerLimits(max_structured_outputs_compiles=0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--structured-outputs-compile-timeout must be > 0"):
            ServerLimits(structured_outputs_compile_timeout=bad)


BIG = 128 * 2**10 + 1  # one byte past the default spec-size cap
DEEP_STRING = "[" * 10_000 + "]" * 10_000  # json.loads recursed into a 500 on this


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    (COMPLETIONS, completion(guided_json=enum_schema(1001)), "guided_json",
     "guided_json has 1001 enum values, more than 1000 (--max-structured-outputs-choices)"),
    # Counted across the whole schema, nested enums too.
    (COMPLETIONS, completion(guided_json={"type": "object", "properties": {
        "a": enum_schema(600), "b": {"type": "array", "items": enum_schema(600, 3)}}}),
     "guided_json", "1200 enum values"),
    (COMPLETIONS, completion(guided_choice=[f"c{i}" for i in range(1001)]), "guided_choice",
     "guided_choice has 1001 choices"),
    (COMPLETIONS, completion(structured_outputs={"choice": [f"c{i}" for i in range(1001)]}),
     "structured_outputs", "structured_outputs.choice has 1001 choices"),
    (COMPLETIONS, completion(guided_regex="a" * BIG), "guided_regex",
     "guided_regex is larger than 131072 bytes (--max-structured-outputs-spec-bytes)"),
    (COMPLETIONS, completion(guided_grammar='root ::= "' + "a" * BIG + '"'), "guided_grammar",
     "--max-structured-outputs-spec-bytes"),
    (COMPLETIONS, completion(guided_choice=["é" * (BIG // 3)] * 2), "guided_choice",
     "--max-structured-outputs-spec-bytes"),  # UTF-8 bytes, not characters
    (COMPLETIONS, completion(guided_json=json.dumps({"enum": ["x" * BIG]})), "guided_json",
     "--max-structured-outputs-spec-bytes"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "description": "x" * BIG}}}),
     "response_format", "response_format is larger than 131072 bytes"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": nested(25)}}),
     "response_format", "nests deeper than 24 levels (--max-structured-outputs-depth)"),
    # A schema as a string: the body's depth check cannot see into it.
    (COMPLETIONS, completion(guided_json=json.dumps(nested(25))), "guided_json",
     "guided_json nests deeper than 24 levels"),
    (COMPLETIONS, completion(structured_outputs={"json": DEEP_STRING}), "structured_outputs",
     "structured_outputs.json nests deeper than 24 levels"),
    (CHAT, chat(tools=[tool(f"f{i}") for i in range(129)]), "tools",
     "tools has 129 tools, more than 128 (--max-tools)"),
    # A forced tool_choice: the tools' parameters, counted together.
    (CHAT, chat(tools=[tool(f"f{i}", enum_schema(300)) for i in range(4)],
                tool_choice="required"), "tools", "tools has 1200 enum values"),
    (CHAT, chat(tools=[tool("f", nested(25)), tool("g")],
                tool_choice={"type": "function", "function": {"name": "f"}}), "tools",
     "tools nests deeper than 24 levels"),
])
def test_caps_are_400s_naming_the_field_before_any_compile(path, body, param, needle):
    async def send(client, engine):
        resp = await client.post(path, json=body)
        return resp, engine.input_processor.grammar_compiler.stats

    resp, stats = run(send)
    assert_error(resp, 400, param, needle)
    assert stats.misses == 0 and stats.compile_seconds == 0.0  # refused before compiling


def test_within_the_caps_and_compile_errors():
    async def send(client, engine):
        return [await client.post(COMPLETIONS, json=completion(guided_json=enum_schema(1000))),
                await client.post(CHAT, json=chat(
                    tools=[tool(f"f{i}", enum_schema(250)) for i in range(4)],
                    tool_choice="required")),
                await client.post(COMPLETIONS, json=completion(
                    guided_json=json.dumps(nested(23)))),
                await client.post(COMPLETIONS, json=completion(guided_regex="(ab")),
                await client.post(CHAT, json=chat(guided_grammar="root ::= nope"))]

    at_cap, tools_at_cap, deep_ok, bad_regex, bad_grammar = run(send)
    assert at_cap.status_code == 200, at_cap.text
    assert tools_at_cap.status_code == 200, tools_at_cap.text  # the tool names are not counted
    assert deep_ok.status_code == 200, deep_ok.text
    assert_error(bad_regex, 400, "guided_regex", "guided_regex: invalid regex")
    assert_error(bad_grammar, 400, "guided_grammar", "guided_grammar: invalid EBNF grammar")


def test_the_grammar_cache_is_per_tenant():
    keys = ApiKeys([ApiKey("key-a", "a"), ApiKey("key-a2", "a"), ApiKey("key-b", "b")])
    body = completion(guided_json={"type": "object", "properties": {"t": {"enum": ["x", "y"]}}})

    async def send(client, engine):
        stats = engine.input_processor.grammar_compiler.stats
        seen = []
        for key in ("key-a", "key-b", "key-a2"):
            resp = await client.post(COMPLETIONS, json=body,
                                     headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200, resp.text
            seen.append((stats.misses, stats.hits))
        return seen

    # Tenant b compiles its own (a miss); a's second key is the same tenant (a hit).
    assert run(send, app_kwargs={"api_key": keys}) == [(1, 0), (2, 0), (2, 1)]


async def tick_while(task: asyncio.Task) -> float:
    """The longest gap between 10 ms ticks on this loop while ``task`` runs."""
    gap, last = 0.0, time.perf_counter()
    while not task.done():
        await asyncio.sleep(0.01)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    return gap


def test_a_large_compile_runs_off_the_event_loop():
    async def send(client, engine):
        request = asyncio.ensure_future(client.post(COMPLETIONS, json=completion(
            guided_json=SLOW_SCHEMA)))
        gap = await tick_while(request)
        return request.result(), gap, engine.input_processor.grammar_compiler.stats

    resp, gap, stats = run(send, limits=ServerLimits(**ROOMY))
    assert resp.status_code == 200, resp.text
    # One compile, on the grammar threads; adding the request did not compile it again (a hit).
    assert (stats.misses, stats.hits) == (1, 0)
    assert gap < stats.compile_seconds / 4, (gap, stats.compile_seconds)


def test_compile_timeout_is_a_503_and_the_retry_finds_it_cached():
    async def send(client, engine):
        body = completion(guided_json=SLOW_SCHEMA)
        timed_out = await client.post(COMPLETIONS, json=body)
        health = await client.get("/health")
        assert engine.grammar_pool.num_pending == 1  # still compiling, holding its slot
        for _ in range(6000):
            if not engine.grammar_pool.num_pending:
                break
            await asyncio.sleep(0.01)
        retry = await client.post(COMPLETIONS, json=body)
        return timed_out, health, retry, engine.input_processor.grammar_compiler.stats

    timed_out, health, retry, stats = run(send, limits=ServerLimits(
        **ROOMY, structured_outputs_compile_timeout=0.2))
    err = assert_error(timed_out, 503, None, "(--structured-outputs-compile-timeout)")
    assert err["code"] == "structured_outputs_compile_timeout"
    assert timed_out.headers["Retry-After"] == "1"
    assert health.status_code == 200
    assert retry.status_code == 200, retry.text
    assert (stats.misses, stats.hits) == (1, 1)


def test_full_compile_queue_is_a_503_but_the_same_spec_joins():
    async def send(client, engine):
        slow = completion(guided_json=SLOW_SCHEMA)
        first = asyncio.ensure_future(client.post(COMPLETIONS, json=slow))
        for _ in range(500):
            if engine.grammar_pool.num_pending:
                break
            await asyncio.sleep(0.01)
        joined = asyncio.ensure_future(client.post(COMPLETIONS, json=slow))
        other = await client.post(COMPLETIONS, json=completion(guided_regex="[0-9]+"))
        return other, await first, await joined, engine.input_processor.grammar_compiler.stats

    other, first, joined, stats = run(send, limits=ServerLimits(
        **ROOMY, max_structured_outputs_compiles=1))
    err = assert_error(other, 503, None, "(--max-structured-outputs-compiles)")
    assert err["code"] == "server_overloaded" and other.headers["Retry-After"] == "1"
    assert first.status_code == 200 and joined.status_code == 200, (first.text, joined.text)
    assert stats.misses == 1  # the joined request waited for the first one's compile
