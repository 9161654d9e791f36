"""Structured outputs through the offline engine on a tiny random-weight Llama: every kind of
constraint gives output the independent reference accepts (jsonschema, re, json), alone and
mixed with free requests, with n > 1, sampling, logprobs, min_tokens and stop strings."""

from __future__ import annotations

import json
import math
import re

import pytest
from so_utils import (
    CHOICES,
    EMAIL_REGEX,
    PERSON_SCHEMA,
    SUM_GRAMMAR,
    SUM_REGEX,
    check_json,
    check_regex,
    prompts,
)

from pagellm import LLM, SamplingParams, StructuredOutputsParams

MAX_TOKENS = 180


def constrained(spec: StructuredOutputsParams, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=spec, **kw)


def vocab(llm: LLM) -> int:
    return llm.llm_engine.config.model.vocab_size


def test_json_schema_greedy_and_sampled(tiny_llm) -> None:
    spec = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)
    ps = prompts(4, vocab(tiny_llm), seed=1)
    params = [constrained(spec)] * 2 + [constrained(spec, temperature=1.0, seed=7 + i)
                                        for i in range(2)]
    for out in tiny_llm.generate(ps, params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        check_json(c.text, PERSON_SCHEMA)
        # Properties come in the schema's order.
        assert list(json.loads(c.text)) == list(PERSON_SCHEMA["properties"])


def test_json_schema_as_string_any_whitespace(tiny_llm) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = StructuredOutputsParams(json=json.dumps(schema))
    out = tiny_llm.generate(prompts(1, vocab(tiny_llm), seed=2), constrained(spec),
                            use_tqdm=False)[0].outputs[0]
    if out.finish_reason == "stop":
        check_json(out.text, schema)
    else:  # free whitespace may run to max_tokens on random weights: still a valid prefix
        assert out.finish_reason == "length" and out.text.lstrip().startswith("{")


def test_regex_choice_grammar_json_object(tiny_llm) -> None:
    ps = prompts(3, vocab(tiny_llm), seed=3)
    cases = [
        (StructuredOutputsParams(regex=EMAIL_REGEX), lambda t: check_regex(t, EMAIL_REGEX)),
        (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
        (StructuredOutputsParams(grammar=SUM_GRAMMAR), lambda t: check_regex(t, SUM_REGEX)),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
         lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    ]
    for spec, check in cases:
        for temperature in (0.0, 1.0):
            outs = tiny_llm.generate(ps, constrained(spec, temperature=temperature, seed=3),
                                     use_tqdm=False)
            for out in outs:
                c = out.outputs[0]
                assert c.finish_reason == "stop", (spec.kind, c.text)
                check(c.text)


def test_every_choice_reachable_and_exact(tiny_llm) -> None:
    """Sampling over many seeds: only whole choices come out (escapes round-trip)."""
    spec = StructuredOutputsParams(choice=CHOICES)
    params = [constrained(spec, temperature=2.0, seed=s) for s in range(24)]
    outs = tiny_llm.generate(prompts(1, vocab(tiny_llm), seed=4) * 24, params, use_tqdm=False)
    texts = {o.outputs[0].text for o in outs}
    assert texts <= set(CHOICES) and len(texts) >= 2, texts


def test_mixed_batch_keeps_free_requests_unchanged(tiny_llm) -> None:
    ps = prompts(4, vocab(tiny_llm), seed=5)
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = StructuredOutputsParams(regex=EMAIL_REGEX)
    params = [free if i % 2 == 0 else constrained(spec) for i in range(len(ps))]
    together = tiny_llm.generate(ps, params, use_tqdm=False)
    for p, sp, out in zip(ps, params, together, strict=True):
        alone = tiny_llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids
        if sp.structured_outputs is not None:
            check_regex(out.outputs[0].text, EMAIL_REGEX)


def test_n_samples_each_follow_the_grammar(tiny_llm) -> None:
    spec = StructuredOutputsParams(regex=EMAIL_REGEX)
    out = tiny_llm.generate(prompts(1, vocab(tiny_llm), seed=6),
                            constrained(spec, n=4, temperature=1.0, seed=11), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop"
        check_regex(c.text, EMAIL_REGEX)
    assert len({c.text for c in out.outputs}) > 1


def test_logprobs_are_of_the_allowed_distribution(tiny_llm) -> None:
    spec = StructuredOutputsParams(choice=["alpha", "beta"])
    c = tiny_llm.generate(prompts(1, vocab(tiny_llm), seed=7), constrained(spec, logprobs=3),
                          use_tqdm=False)[0].outputs[0]
    assert c.text in ("alpha", "beta")
    assert len(c.logprobs) == len(c.token_ids)
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert math.isfinite(entry[tok].logprob)
        # Tokens the grammar masks have probability 0 (-inf), so the allowed ones sum to 1.
        allowed = [lp.logprob for lp in entry.values() if math.isfinite(lp.logprob)]
        assert sum(math.exp(lp) for lp in allowed) <= 1.0 + 1e-4


def test_min_tokens_holds_back_the_end_while_the_grammar_can_go_on(tiny_llm) -> None:
    ps = prompts(4, vocab(tiny_llm), seed=8)
    spec = StructuredOutputsParams(regex=r"[a-z]{1,30}")
    for out in tiny_llm.generate(ps, constrained(spec, min_tokens=6), use_tqdm=False):
        c = out.outputs[0]
        check_regex(c.text, r"[a-z]{1,30}")
        assert c.finish_reason == "stop" and len(c.token_ids) >= 6
    # A grammar whose output is complete ends the request even short of min_tokens.
    done = tiny_llm.generate(ps[:1], constrained(StructuredOutputsParams(choice=["ok"]),
                                                 min_tokens=8), use_tqdm=False)[0].outputs[0]
    assert done.text == "ok" and done.finish_reason == "stop"


def test_stop_string_and_max_tokens_cut_constrained_output(tiny_llm) -> None:
    ps = prompts(1, vocab(tiny_llm), seed=9)
    spec = StructuredOutputsParams(regex=r"[a-z]{3}(,[a-z]{3}){5}")
    full = tiny_llm.generate(ps, constrained(spec), use_tqdm=False)[0].outputs[0]
    check_regex(full.text, r"[a-z]{3}(,[a-z]{3}){5}")
    cut = tiny_llm.generate(ps, constrained(spec, stop=","), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == full.text.split(",")[0]
    short = tiny_llm.generate(ps, constrained(spec, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "length" and full.text.startswith(short.text)


def test_invalid_specs_raise_at_add_time_and_leak_nothing(tiny_llm) -> None:
    engine = tiny_llm.llm_engine
    bad = {
        "json": StructuredOutputsParams(json={"type": "object", "properties": {"a": {
            "$ref": "#/definitions/missing"}}}),
        "regex": StructuredOutputsParams(regex="(ab"),
        "grammar": StructuredOutputsParams(grammar="root ::= undefined_rule"),
    }
    for i, (kind, spec) in enumerate(bad.items()):
        with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind}: invalid ") as info:
            engine.add_request(f"bad-{i}", {"prompt_token_ids": [5, 6, 7]}, constrained(spec))
        assert "/project/" not in str(info.value)  # xgrammar's source path is stripped
    assert not engine.has_unfinished_requests()
    assert engine.output_processor.requests == {}
    assert engine.engine_core.structured_output.num_requests == 0
    assert engine.engine_core.scheduler.kv_cache_manager.usage == 0.0
    # The engine goes on serving.
    ok = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           constrained(StructuredOutputsParams(choice=["fine"])),
                           use_tqdm=False)[0].outputs[0]
    assert ok.text == "fine"


def test_compiled_grammar_cache_hits(tiny_llm) -> None:
    compiler = tiny_llm.llm_engine.input_processor.grammar_compiler
    schema = {"type": "object", "properties": {"zz_unique": {"type": "integer"}}}
    before = (compiler.stats.hits, compiler.stats.misses)
    first = compiler.compile(StructuredOutputsParams(json=schema))
    # The same schema as a string (other spacing): same key, the same compiled object.
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(schema, indent=2)))
    assert again is first
    assert (compiler.stats.hits, compiler.stats.misses) == (before[0] + 1, before[1] + 1)
    # Whitespace mode is part of the key.
    compact = compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert compact is not first


def test_choice_grammar_escapes() -> None:
    from pagellm.structured_output.compiler import choice_grammar

    text = choice_grammar(CHOICES)
    assert re.match(r'^root ::= "say \\"yes\\"" \| ', text), text
