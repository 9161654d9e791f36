"""The whitespace cap on the real default model (SmolLM2-135M-Instruct): a nested-schema chat
answer closes and validates (jsonschema) within a small max_tokens, and every run of free
whitespace in it is within the cap the request asked for."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.structured_output.params import DEFAULT_MAX_WHITESPACE_CNT

pytestmark = pytest.mark.slow

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "running"]},
                    "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "country": {"enum": ["France", "Italy", "Germany"]}},
                    "required": ["city", "country"]},
    },
    "required": ["name", "age", "hobbies", "address"],
}
ASK = [{"role": "user", "content": "Invent a person who lives in Paris, as JSON."}]
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="512MiB", max_model_len=2048, seed=0)


def longest_free_whitespace(text: str) -> int:
    """The longest run of whitespace outside JSON strings."""
    bare = _STRING.sub('""', text)
    return max((len(m) for m in re.findall(r"\s+", bare)), default=0)


def test_nested_answer_closes_within_the_cap(default_llm) -> None:
    specs = [StructuredOutputsParams(json=PERSON_SCHEMA),
             StructuredOutputsParams(json=PERSON_SCHEMA, max_whitespace_cnt=2)]
    params = [SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=s)
              for s in specs]
    outs = default_llm.chat([ASK, ASK], params, use_tqdm=False)
    for spec, out in zip(specs, outs, strict=True):
        answer = out.outputs[0]
        assert answer.finish_reason == "stop", answer.text
        jsonschema.validate(json.loads(answer.text), PERSON_SCHEMA)
        assert longest_free_whitespace(answer.text) <= spec.max_whitespace_cnt, answer.text
    assert specs[0].max_whitespace_cnt == DEFAULT_MAX_WHITESPACE_CNT
