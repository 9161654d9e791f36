"""Structured outputs through AsyncLLM and the engine-core process (the server's path): the
frontend refuses a bad spec with ValueError before anything is sent, and the core process
compiles the grammar itself and constrains the output."""

from __future__ import annotations

import asyncio

import pytest
from so_utils import EMAIL_REGEX, PERSON_SCHEMA, check_json, check_regex

from pagellm import EngineArgs, SamplingParams, StructuredOutputsParams
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.output_processor import OutputKind


def test_async_engine_constrains_and_refuses(tiny_path) -> None:
    config = EngineArgs(model=tiny_path, dtype="float32", max_model_len=256,
                        kv_cache_memory="32MiB").create_engine_config()

    async def main() -> None:
        engine = AsyncLLM(config, log_stats=False)
        try:
            with pytest.raises(ValueError, match=r"^structured_outputs\.regex: invalid regex"):
                engine.add_request("bad", "hi", SamplingParams(
                    structured_outputs=StructuredOutputsParams(regex="[a-")))
            assert engine.num_unfinished_requests == 0
            json_params = SamplingParams(
                temperature=0.0, max_tokens=180, structured_outputs=StructuredOutputsParams(
                    json=PERSON_SCHEMA, disable_any_whitespace=True))
            regex_params = SamplingParams(
                temperature=1.0, seed=3, n=2, max_tokens=60,
                structured_outputs=StructuredOutputsParams(regex=EMAIL_REGEX))
            outs = await asyncio.gather(_final(engine, "j", json_params),
                                        _final(engine, "r", regex_params))
            check_json(outs[0].outputs[0].text, PERSON_SCHEMA)
            assert len(outs[1].outputs) == 2
            for c in outs[1].outputs:
                assert c.finish_reason == "stop"
                check_regex(c.text, EMAIL_REGEX)
        finally:
            await engine.aclose()

    asyncio.run(main())


async def _final(engine: AsyncLLM, request_id: str, params: SamplingParams):
    outs = [o async for o in engine.generate("the quick fox", params, request_id,
                                             kind=OutputKind.FINAL_ONLY)]
    assert len(outs) == 1 and outs[0].finished
    return outs[0]
