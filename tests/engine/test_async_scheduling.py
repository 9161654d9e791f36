"""LLM(async_scheduling=True) against the synchronous engine on the same tiny model: identical
greedy and seeded-random outputs over a mixed workload (prompt lengths, max_tokens, EOS and
stop tokens, n > 1, logprobs, chunked prefill, prefix hits), under preemption, with a
structured-output request mixed in (synchronous fallback steps); aborts while a step is in
flight and failed steps leak no KV block."""

from __future__ import annotations

import argparse
import random

import pytest

from pagellm import LLM, SamplingParams, StructuredOutputsParams
from pagellm.engine.fault_injection import ENV_VAR
from pagellm.engine_args import EngineArgs

EOS = 2  # the tiny test tokenizer's
STOP = 17
ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory="16MiB", seed=0,
              max_num_batched_tokens=32, max_num_seqs=8)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def engines(model_path):
    """(synchronous, async) engines: small token budget (prompts chunked), prefix caching."""
    kw = dict(ENGINE, enable_prefix_caching=True)
    sync = LLM(model=model_path, **kw)
    overlapped = LLM(model=model_path, async_scheduling=True, **kw)
    yield sync, overlapped
    overlapped.llm_engine.shutdown()


def workload(seed: int, num: int = 14) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 400) for _ in range(40)]
    prompts, params = [], []
    for i in range(num):
        ids = [rng.randrange(3, 400) for _ in range(rng.randint(1, 60))]
        if i % 4 == 0:
            ids = shared[: rng.choice([16, 33, 40])] + ids  # prefix hits
        prompts.append({"prompt_token_ids": ids})
        max_tokens = rng.choice([1, 3, 9, 24])
        kind = i % 5
        if kind == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=2)
        elif kind == 1:  # EOS made likely: requests stop at different steps
            sp = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24,
                                logit_bias={EOS: 3.0})
        elif kind == 2:  # a stop token made likely
            sp = SamplingParams(temperature=1.0, top_p=0.9, seed=200 + i, max_tokens=24,
                                stop_token_ids=[STOP], logit_bias={STOP: 3.0})
        elif kind == 3:  # parallel samples of one prompt
            sp = SamplingParams(temperature=0.8, seed=300 + i, n=2, max_tokens=max_tokens)
        else:  # runs into max_model_len
            sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        params.append(sp)
    return prompts, params


def summary(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


def assert_same_logprobs(want, got) -> None:
    for w, g in zip(want, got, strict=True):
        for cw, cg in zip(w.outputs, g.outputs, strict=True):
            if cw.logprobs is None:
                assert cg.logprobs is None
                continue
            for lw, lg in zip(cw.logprobs, cg.logprobs, strict=True):
                assert lw.keys() == lg.keys()
                for tok in lw:
                    assert lg[tok].logprob == pytest.approx(lw[tok].logprob, abs=1e-4)


def assert_idle(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    sched = core.scheduler
    assert not core.has_unfinished_requests() and core.overlap.in_flight is None
    assert not sched.requests and not sched.running and not sched.waiting
    kv = sched.kv_cache_manager
    kv.block_pool.check_invariants()
    assert kv.get_num_free_blocks() == core.num_blocks  # no leaked block
    assert not llm.llm_engine.output_processor.requests


def test_flag() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling
    assert not EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling


def test_refused_with_speculative_decoding(model_path) -> None:
    args = EngineArgs(model=model_path, async_scheduling=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="--async-scheduling.*--speculative-config"):
        args.create_engine_config()


def test_outputs_match_synchronous_engine(engines) -> None:
    sync, overlapped = engines
    prompts, params = workload(seed=0)
    stats = overlapped.llm_engine.engine_core.stats
    gen_before = stats.num_generation_tokens
    want = sync.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert summary(got) == summary(want)
    assert_same_logprobs(want, got)
    reasons = {c.finish_reason for o in want for c in o.outputs}
    stop_reasons = {c.stop_reason for o in want for c in o.outputs}
    assert reasons == {"stop", "length"} and STOP in stop_reasons  # EOS, stop token, lengths
    # The prompts of the second run hit the cache the first run filled.
    assert sum(o.num_cached_tokens for o in got) > 0
    # Only emitted tokens are counted (a token computed after a stop is dropped).
    emitted = sum(len(c.token_ids) for o in got for c in o.outputs)
    assert stats.num_generation_tokens - gen_before == emitted
    assert_idle(overlapped)
    # Again, now that every prompt prefix is cached.
    assert summary(overlapped.generate(prompts, params, use_tqdm=False)) == summary(want)
    assert_idle(overlapped)


def test_preemption_under_a_tiny_kv_cache(model_path) -> None:
    prompts, params = workload(seed=1, num=10)
    kw = dict(ENGINE, num_gpu_blocks_override=12)  # 192 slots for ~10 requests
    want = LLM(model=model_path, **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model_path, async_scheduling=True, **kw)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert summary(got) == summary(want)
    assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0
    assert_idle(llm)


def test_prompt_logprobs_match(engines) -> None:
    """Prompt scores come with each prefill chunk (32-token budget: several per prompt)."""
    sync, overlapped = engines
    prompts, _ = workload(seed=4, num=4)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    want = sync.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert summary(got) == summary(want)
    for w, g in zip(want, got, strict=True):
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for ew, eg in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:], strict=True):
            assert ew.keys() == eg.keys()
            for tok in ew:
                assert eg[tok].logprob == pytest.approx(ew[tok].logprob, abs=1e-4)
    assert_idle(overlapped)


def test_structured_output_request_mixed_in(engines) -> None:
    """A constrained request makes the engine step synchronously while it runs; the others
    get the same tokens either way."""
    sync, overlapped = engines
    prompts, params = workload(seed=2, num=8)
    choices = ["alpha beta", "gamma", "delta epsilon"]
    prompts.insert(3, {"prompt_token_ids": [5, 6, 7, 8]})
    params.insert(3, SamplingParams(temperature=0.0, max_tokens=16,
                                    structured_outputs=StructuredOutputsParams(choice=choices)))
    want = sync.generate(prompts, params, use_tqdm=False)
    got = overlapped.generate(prompts, params, use_tqdm=False)
    assert got[3].outputs[0].text in choices
    assert summary(got) == summary(want)
    assert_idle(overlapped)


def test_aborts_while_a_step_is_in_flight_leak_no_block(engines) -> None:
    _, overlapped = engines
    engine = overlapped.llm_engine
    core = engine.engine_core
    prompts, _ = workload(seed=3, num=10)
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, long)
    finished: dict[str, str] = {}
    for step in range(40):
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.outputs[0].finish_reason
        if step in (1, 4, 9):  # a step is in flight right now
            assert core.overlap.in_flight is not None
            victims = [f"a{i}" for i in range(step % 3, 10, 3) if f"a{i}" not in finished]
            engine.abort_request(victims)
            for v in victims:
                finished[v] = "abort"
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.outputs[0].finish_reason
    assert len(finished) == 10 and "abort" in finished.values()
    assert "length" in finished.values()
    assert_idle(overlapped)


@pytest.mark.parametrize("stage", ["before", "forward"])
def test_failed_step_fails_both_steps_in_flight_and_the_engine_goes_on(
        monkeypatch, model_path, engines, stage) -> None:
    sync, _ = engines
    poison = 7
    good = [{"prompt_token_ids": [10 + i, 20 + i, 30 + i, 40 + i] * (3 + i)} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = summary(sync.generate(good, greedy, use_tqdm=False))
    monkeypatch.setenv(ENV_VAR, f"{stage}:{poison}")
    llm = LLM(model=model_path, async_scheduling=True, enable_prefix_caching=True, **ENGINE)
    engine = llm.llm_engine
    for i in range(2):
        engine.add_request(f"early{i}", good[i], greedy)
    for _ in range(3):
        assert all(not o.finished for o in engine.step())
    engine.add_request("bad", {"prompt_token_ids": [11, 12, poison, 13] * 5},
                       SamplingParams(max_tokens=4, n=2))
    finished: dict[str, set] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = {c.finish_reason for c in o.outputs}
    # The step that admitted "bad" raised: its requests, and those of the step scheduled after
    # it, fail; the engine goes on.
    assert finished == {"bad": {"error"}, "early0": {"error"}, "early1": {"error"}}
    assert engine.engine_core.num_failed_steps == 1
    assert_idle(llm)
    assert summary(llm.generate(good, greedy, use_tqdm=False)) == reference
    assert_idle(llm)
    engine.shutdown()
