"""Structured outputs under tensor parallelism (CPU, gloo, two ranks): the step's grammar
bitmask travels with the SchedulerOutput to rank 0, which samples, so the two-rank engine gives
the one-rank engine's constrained greedy tokens, even with chunked prefill and preemption."""

from __future__ import annotations

import json
import re

import jsonschema
from tp_utils import run, tp1_llm, tp2_llm

from pagellm import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "kind": {"enum": ["cat", "dog"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}},
          "required": ["id", "kind", "tags"]}
REGEX = r"[a-z]{1,8}-[0-9]{1,3}"
PROMPTS = ["hello world", "the quick brown fox jumps", "paged attention stores keys",
           "json name age city", "how are you today", "lazy dog over the fox"]


def test_tp2_constrained_tokens_match_tp1(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    specs = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
             StructuredOutputsParams(regex=REGEX)]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=specs[i % 2])
              for i in range(len(PROMPTS))]
    free = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    params[-1] = free  # one free request in the batch
    expect = run(tp1_llm(path), PROMPTS, params)
    tp2 = tp2_llm(path)
    try:
        got = run(tp2, PROMPTS, params)
    finally:
        tp2.llm_engine.shutdown()
    for sp, a, b in zip(params, expect, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        text = b.outputs[0].text
        if sp.structured_outputs is specs[0]:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif sp.structured_outputs is specs[1]:
            assert re.fullmatch(REGEX, text), text
