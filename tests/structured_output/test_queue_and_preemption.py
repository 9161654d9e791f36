"""The engine core around a grammar: a request waits while its grammar compiles and the others
run meanwhile; preemption (recompute) keeps constrained output valid and unchanged."""

from __future__ import annotations

import threading

import pytest
from so_utils import EMAIL_REGEX, PERSON_SCHEMA, check_json, check_regex, prompts

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.errors import RequestFailedError
from pagellm.request import RequestStatus


class GatedCompiler:
    """The engine core's compiler, held until ``gate`` opens (a slow compile)."""

    def __init__(self, inner, gate: threading.Event) -> None:
        self.inner = inner
        self.gate = gate
        self.vocab_size = inner.vocab_size

    def compile(self, spec, namespace=None):
        assert self.gate.wait(60)
        return self.inner.compile(spec, namespace)


def test_requests_run_while_a_grammar_compiles(tiny_llm) -> None:
    engine = tiny_llm.llm_engine
    core = engine.engine_core
    manager = core.structured_output
    gate = threading.Event()
    inner = manager.compiler
    manager.compiler = GatedCompiler(inner, gate)
    spec = StructuredOutputsParams(regex=EMAIL_REGEX)
    try:
        engine.add_request("c", "hello world", SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=spec))
        engine.add_request("gone", "the fox", SamplingParams(
            temperature=0.0, max_tokens=40, structured_outputs=spec))
        engine.add_request("f", "the quick brown fox", SamplingParams(
            temperature=0.0, max_tokens=4, ignore_eos=True))
        engine.abort_request("gone")  # aborted while compiling: nothing stays behind
        outputs = {}
        for _ in range(20):
            for out in engine.step():
                outputs[out.request_id] = out
            if "f" in outputs and outputs["f"].finished:
                break
        assert outputs["f"].finished and len(outputs["f"].outputs[0].token_ids) == 4
        assert "c" not in outputs
        waiting = core.scheduler.requests["c"]
        assert waiting.status == RequestStatus.WAITING and not waiting.grammar.ready
        # Only grammars left: a step waits for them instead of running the model.
        num_steps = core.stats.num_steps
        assert engine.step() == [] and core.stats.num_steps == num_steps
        gate.set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
    finally:
        gate.set()
        manager.compiler = inner
    c = outputs["c"].outputs[0]
    assert c.finish_reason == "stop"
    check_regex(c.text, EMAIL_REGEX)
    assert "gone" not in outputs and manager.num_compiling == 0 and manager.num_requests == 0
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_preemption_keeps_constrained_output(tiny_path, tiny_llm) -> None:
    ps = prompts(6, 0, seed=21)
    json_spec = StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True)
    regex_spec = StructuredOutputsParams(regex=EMAIL_REGEX)
    params = [SamplingParams(temperature=0.0 if i % 3 else 0.8, seed=i, max_tokens=180,
                             structured_outputs=json_spec if i % 2 else regex_spec)
              for i in range(len(ps))]
    # Greedy and seeded output does not depend on the batch (tests/e2e/test_tiny_engine.py).
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(ps, params, use_tqdm=False)]
    # 24 blocks of 16 tokens cannot hold 6 requests of ~120 tokens: the scheduler preempts
    # (recompute) and chunks prompts with a 32-token budget.
    tight = LLM(model=tiny_path, dtype="float32", max_model_len=256, max_num_seqs=6,
                max_num_batched_tokens=32, num_gpu_blocks_override=24)
    outs = tight.generate(ps, params, use_tqdm=False)
    core = tight.llm_engine.engine_core
    assert core.make_stats().num_preemptions > 0
    for sp, out, expect in zip(params, outs, alone, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop"
        if sp.structured_outputs is json_spec:
            check_json(c.text, PERSON_SCHEMA)
        else:
            check_regex(c.text, EMAIL_REGEX)
        assert c.token_ids == expect
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.scheduler.kv_cache_manager.block_pool.check_invariants()


class FailingCompiler:
    """An engine-core compile that fails (the frontend's succeeded): an engine fault."""

    def __init__(self, inner) -> None:
        self.vocab_size = inner.vocab_size

    def compile(self, spec, namespace=None):
        raise RuntimeError("injected compile failure")


def test_a_failed_core_compile_fails_only_its_request(tiny_llm) -> None:
    engine = tiny_llm.llm_engine
    manager = engine.engine_core.structured_output
    inner = manager.compiler
    manager.compiler = FailingCompiler(inner)
    try:
        with pytest.raises(RequestFailedError) as info:
            tiny_llm.generate(
                ["hello world", "the fox"],
                [SamplingParams(temperature=0.0, max_tokens=20,
                                structured_outputs=StructuredOutputsParams(regex=EMAIL_REGEX)),
                 SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)],
                use_tqdm=False)
    finally:
        manager.compiler = inner
    outs = info.value.outputs
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    assert outs[1].outputs[0].finish_reason == "length"
    assert len(outs[1].outputs[0].token_ids) == 5
    assert manager.num_compiling == 0 and manager.num_requests == 0
    assert engine.engine_core.scheduler.kv_cache_manager.usage == 0.0
