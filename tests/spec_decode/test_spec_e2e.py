"""Speculative decoding end to end on a tiny random model: greedy output token for token
identical to decoding without it, in mixed batches, with n > 1, stops inside accepted runs,
prefix caching, preemption and logprobs; drafts do get accepted (no vacuous pass).

A random tiny model rarely repeats itself, so n-gram drafts are rarely accepted on it; most tests
also run with an oracle proposer (oracle.py) that drafts the model's true continuation, wrong
from one position on, so every acceptance count happens with the real model and KV cache."""

from __future__ import annotations

import random

import pytest
from oracle import OracleProposer

from pagellm import LLM, SamplingParams, StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": None}
ENGINE = {"dtype": "float32", "max_model_len": 256}


def _prompts(n: int, seed: int) -> list[dict]:
    """Repetitive prompts (a random phrase said several times) and plain random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 2 == 0:
            phrase = [rng.randrange(3, 300) for _ in range(rng.randint(4, 12))]
            ids = phrase * rng.randint(2, 4)
        else:
            ids = [rng.randrange(3, 300) for _ in range(rng.randint(5, 60))]
        prompts.append({"prompt_token_ids": ids})
    return prompts


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def _accepted(llm: LLM) -> int:
    stats = llm.llm_engine.engine_core.make_stats().spec_decoding
    assert stats is not None
    return stats.num_accepted_tokens


def _use_proposer(kind: str, llm: LLM, plain: LLM, prompts: list[dict], monkeypatch) -> None:
    """``kind`` "oracle": replace ``llm``'s n-gram proposer by one that knows ``plain``'s greedy
    continuations of ``prompts``."""
    if kind == "ngram":
        return
    outs = plain.generate(prompts, SamplingParams(temperature=0.0, max_tokens=80,
                                                  ignore_eos=True), use_tqdm=False)
    refs = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}
    spec_runner = llm.llm_engine.engine_core.executor.runner.spec_decode
    vocab = llm.llm_engine.config.model.vocab_size
    monkeypatch.setattr(spec_runner, "proposer", OracleProposer(refs, vocab))


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def plain(tiny_path) -> LLM:
    return LLM(model=tiny_path, kv_cache_memory="32MiB", **ENGINE)


@pytest.fixture(scope="module")
def spec(tiny_path) -> LLM:
    return LLM(model=tiny_path, kv_cache_memory="32MiB", speculative_config=SPEC, **ENGINE)


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
def test_greedy_identical_and_drafts_accepted(plain, spec, proposer, monkeypatch) -> None:
    prompts = _prompts(8, seed=0)
    _use_proposer(proposer, spec, plain, prompts, monkeypatch)
    stats_before = spec.llm_engine.engine_core.make_stats().spec_decoding
    assert _tokens(spec.generate(prompts, GREEDY, use_tqdm=False)) == \
        _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    stats = spec.llm_engine.engine_core.make_stats().spec_decoding.since(stats_before)
    assert stats.num_accepted_tokens > 0
    if proposer == "oracle":  # every acceptance count, from none to all 3
        assert stats.num_accepted_tokens > 0.4 * stats.num_draft_tokens
        assert stats.num_accepted_tokens_per_pos[2] > 0
    # One at a time (batch 1, the case speculation is for) gives the same too.
    for p in prompts[:3]:
        assert _tokens(spec.generate(p, GREEDY, use_tqdm=False)) == \
            _tokens(plain.generate(p, GREEDY, use_tqdm=False))
    core = spec.llm_engine.engine_core
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.scheduler.kv_cache_manager.block_pool.check_invariants()


def test_mixed_batch_with_requests_that_get_no_drafts(plain, spec, monkeypatch) -> None:
    prompts = _prompts(7, seed=1)
    _use_proposer("oracle", spec, plain, prompts, monkeypatch)
    params = [
        GREEDY,
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, logit_bias={5: 3.0}, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=20, ignore_eos=False),
        SamplingParams(temperature=0.0, max_tokens=40, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.5,
                       frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(
            regex="(ab|cd)+")),
    ]
    got = spec.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert got[6].outputs[0].text.replace("ab", "").replace("cd", "") == ""
    pl_got, pl_want = got[4].prompt_logprobs, want[4].prompt_logprobs
    assert [sorted(e) if e else e for e in pl_got] == [sorted(e) if e else e for e in pl_want]


def test_n_greater_than_one(plain, spec, monkeypatch) -> None:
    prompts = _prompts(2, seed=2)
    _use_proposer("oracle", spec, plain, prompts, monkeypatch)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=30, ignore_eos=True)
    got = _tokens(spec.generate(prompts, params, use_tqdm=False))
    assert got == _tokens(plain.generate(prompts, params, use_tqdm=False))
    assert got[0] == got[1] == got[2]


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
def test_stops_inside_accepted_runs(plain, spec, proposer, monkeypatch) -> None:
    prompts = _prompts(6 if proposer == "oracle" else 2, seed=3)
    _use_proposer(proposer, spec, plain, prompts, monkeypatch)
    base = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    for prompt, tokens in zip(prompts, base, strict=True):
        for cut in (5, 17, 30):
            params = [SamplingParams(temperature=0.0, max_tokens=48,
                                     stop_token_ids=[tokens[cut]], ignore_eos=True),
                      SamplingParams(temperature=0.0, max_tokens=cut, ignore_eos=True)]
            got = spec.generate([prompt, prompt], params, use_tqdm=False)
            first = tokens.index(tokens[cut])
            assert got[0].outputs[0].token_ids == tokens[:first + 1]
            assert got[0].outputs[0].finish_reason == "stop"
            assert got[0].outputs[0].stop_reason == tokens[cut]
            assert got[1].outputs[0].token_ids == tokens[:cut]
            assert got[1].outputs[0].finish_reason == "length"


def test_stop_strings_inside_accepted_runs(plain, spec, monkeypatch) -> None:
    prompts = _prompts(4, seed=10)
    _use_proposer("oracle", spec, plain, prompts, monkeypatch)
    checked = 0
    for prompt, out in zip(prompts, plain.generate(prompts, GREEDY, use_tqdm=False),
                           strict=True):
        text = out.outputs[0].text
        stop = text[len(text) // 3:len(text) // 3 + 3]
        if len(stop.strip()) < 2:
            continue
        params = SamplingParams(temperature=0.0, max_tokens=48, stop=[stop], logprobs=0,
                                ignore_eos=True)
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids) == (want.text, want.token_ids)
        assert got.finish_reason == want.finish_reason == "stop" and got.stop_reason == stop
        assert len(got.logprobs) == len(got.token_ids)  # none for tokens after the stop
        checked += 1
    assert checked >= 2


def test_logprobs_of_every_emitted_token(plain, spec, monkeypatch) -> None:
    prompts = _prompts(4, seed=4)
    _use_proposer("oracle", spec, plain, prompts, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, ignore_eos=True)
    got, want = (llm.generate(prompts, params, use_tqdm=False) for llm in (spec, plain))
    for g, w in zip(got, want, strict=True):
        gc, wc = g.outputs[0], w.outputs[0]
        assert gc.token_ids == wc.token_ids
        assert len(gc.logprobs) == len(gc.token_ids)
        for tok, ge, we in zip(gc.token_ids, gc.logprobs, wc.logprobs, strict=True):
            assert ge.keys() == we.keys() and ge[tok].rank == 1
            for t in ge:
                assert ge[t].logprob == pytest.approx(we[t].logprob, abs=1e-4)
        assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-3)


def test_seeded_sampling_is_reproducible(spec) -> None:
    prompts = _prompts(4, seed=5)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=32,
                             ignore_eos=True) for i in range(4)]
    first = _tokens(spec.generate(prompts, params, use_tqdm=False))
    assert first == _tokens(spec.generate(prompts, params, use_tqdm=False))
    assert first[0] != _tokens(spec.generate(prompts[0], params[0].clone(seed=99),
                                             use_tqdm=False))[0]


def test_prefix_caching_hits_and_stays_identical(tiny_path, plain, monkeypatch) -> None:
    llm = LLM(model=tiny_path, kv_cache_memory="32MiB", enable_prefix_caching=True,
              speculative_config=SPEC, **ENGINE)
    prompts = _prompts(4, seed=6)
    want = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    # Each prompt followed by its output: cache hits on the blocks the first run computed.
    longer = [{"prompt_token_ids": p["prompt_token_ids"] + w} for p, w in zip(prompts, want,
                                                                              strict=True)]
    _use_proposer("oracle", llm, plain, prompts + longer, monkeypatch)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(again) == want
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = llm.generate(longer, params, use_tqdm=False)
    assert _tokens(got) == _tokens(plain.generate(longer, params, use_tqdm=False))
    assert all(o.num_cached_tokens >= 48 for o in got)
    assert _accepted(llm) > 0


def test_preemption_stays_identical(tiny_path, plain, monkeypatch) -> None:
    prompts = _prompts(16, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    tight = LLM(model=tiny_path, max_num_seqs=16, max_num_batched_tokens=48,
                num_gpu_blocks_override=30, speculative_config=SPEC, **ENGINE)
    _use_proposer("oracle", tight, plain, prompts, monkeypatch)
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == want
    core = tight.llm_engine.engine_core
    assert core.make_stats().num_preemptions > 0 and _accepted(tight) > 0
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.scheduler.kv_cache_manager.block_pool.check_invariants()


def test_disable_by_batch_size(tiny_path, plain) -> None:
    llm = LLM(model=tiny_path, kv_cache_memory="16MiB",
              speculative_config={**SPEC, "disable_by_batch_size": 2}, **ENGINE)
    prompts = _prompts(4, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # Four requests decode in lockstep and finish together: the batch never drops below 2.
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == \
        _tokens(plain.generate(prompts, params, use_tqdm=False))
    stats = llm.llm_engine.engine_core.make_stats().spec_decoding
    assert stats.num_drafts == 0
    llm.generate(prompts[0], params, use_tqdm=False)  # alone: drafts again
    assert llm.llm_engine.engine_core.make_stats().spec_decoding.num_drafts > 0


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_sliding_window_kv_groups(tmp_path, arch, monkeypatch) -> None:
    """Windowed KV cache groups free blocks behind the window by num_computed_tokens; the
    rollback never moves it below what a step freed by, so verifying stays exact."""
    from sliding_window_models import write_sliding_model

    path = str(write_sliding_model(tmp_path / arch, arch))
    engine = dict(dtype="float32", kv_cache_memory="8MiB", max_model_len=256,
                  max_num_batched_tokens=32)
    plain_llm = LLM(model=path, **engine)
    spec_llm = LLM(model=path, speculative_config=SPEC, **engine)
    prompts = _prompts(4, seed=9)
    _use_proposer("oracle", spec_llm, plain_llm, prompts, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    assert _tokens(spec_llm.generate(prompts, params, use_tqdm=False)) == \
        _tokens(plain_llm.generate(prompts, params, use_tqdm=False))
    assert _accepted(spec_llm) > 0
    kv = spec_llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.usage == 0.0
    kv.block_pool.check_invariants()
