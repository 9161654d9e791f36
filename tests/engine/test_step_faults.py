"""A model step that raises (PAGELLM_FAULT_INJECT, read when the executor is built): the requests
it ran fail with finish_reason "error", their blocks are freed, the scheduler, the block pool and
the runner's persistent batch stay consistent, and later requests get exactly the tokens a clean
engine gives. Repeated failures, or a tensor-parallel worker that raises, stop the engine."""

from __future__ import annotations

import time

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine.core import MAX_CONSECUTIVE_STEP_FAILURES
from pagellm.engine.fault_injection import ENV_VAR, FaultInjector
from pagellm.errors import EngineStepsFailedError, RequestFailedError, WorkerFailedError

POISON = 7  # the token id that makes a step raise; the good prompts never contain it
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
              enable_prefix_caching=True, seed=0)
GOOD = [{"prompt_token_ids": [10 + i, 20 + i, 30 + i, 40 + i] * (3 + 2 * i)} for i in range(4)]
BAD = {"prompt_token_ids": [11, 12, POISON, 13] * 5}


def tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def model_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(model_path) -> list[list[int]]:
    """The good prompts' greedy tokens on an engine without fault injection."""
    llm = LLM(model=model_path, **ENGINE)
    return tokens(llm.generate(GOOD, GREEDY, use_tqdm=False))


def assert_idle_and_consistent(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    sched = core.scheduler
    assert not sched.requests and not sched.running and not sched.waiting
    pool = sched.kv_cache_manager.block_pool
    pool.check_invariants()
    assert sched.kv_cache_manager.usage == 0  # every block back in the free queue
    assert not llm.llm_engine.output_processor.requests
    runner = getattr(core.executor, "runner", None)
    if runner is not None:
        # Rows the runner still holds are only those it will drop at the next step.
        assert set(runner.input_batch.requests) <= sched.finished_req_ids


def test_injector_spec() -> None:
    assert FaultInjector.from_env() is None  # unset: no hook at all
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, "forward:12")
        assert FaultInjector.from_env() == FaultInjector("forward", 12)
        mp.setenv(ENV_VAR, "sideways:12")
        with pytest.raises(ValueError, match=ENV_VAR):
            FaultInjector.from_env()


@pytest.mark.parametrize("stage", ["before", "forward"])
def test_failed_step_fails_its_requests_and_the_engine_goes_on(monkeypatch, model_path,
                                                              reference, stage) -> None:
    monkeypatch.setenv(ENV_VAR, f"{stage}:{POISON}")
    llm = LLM(model=model_path, max_num_seqs=4, **ENGINE)
    engine = llm.llm_engine
    # Two good requests run alone for a few steps (prefilled, decoding, blocks hashed)...
    for i in range(2):
        engine.add_request(f"early{i}", GOOD[i], GREEDY)
    for _ in range(3):
        assert all(not o.finished for o in engine.step())
    # ... then the poisoned one joins: the step that admits it raises, and fails everything
    # it scheduled, the running requests included.
    engine.add_request("bad", BAD, SamplingParams(max_tokens=4, n=2))
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["bad", "early0", "early1"]
    for o in outs:
        assert o.finished and {c.finish_reason for c in o.outputs} == {"error"}
    assert len(next(o for o in outs if o.request_id == "bad").outputs) == 2  # both samples
    assert not engine.has_unfinished_requests()
    assert core_stats(llm)["num_failed_steps"] == 1
    assert_idle_and_consistent(llm)
    # The runner dropped every failed request's row (sent again after the failed step).
    assert engine.step() == []
    assert tokens(llm.generate(GOOD, GREEDY, use_tqdm=False)) == reference
    assert_idle_and_consistent(llm)

    # LLM.generate: the poisoned prompt fails, the rest of the batch still completes. With 4
    # running at most, the good prompts (same max_tokens) all finish before it is admitted.
    with pytest.raises(RequestFailedError, match=r"1 of 5 prompts failed.*\[4\]") as exc:
        llm.generate([*GOOD, BAD], GREEDY, use_tqdm=False)
    outputs = exc.value.outputs
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 4 + ["error"]
    assert tokens(outputs[:4]) == reference
    assert tokens(llm.generate(GOOD, GREEDY, use_tqdm=False)) == reference
    assert_idle_and_consistent(llm)


def core_stats(llm: LLM) -> dict:
    core = llm.llm_engine.engine_core
    return {"num_failed_steps": core.num_failed_steps,
            "num_consecutive": core.num_consecutive_step_failures}


def test_repeated_failures_stop_the_engine(monkeypatch, model_path) -> None:
    monkeypatch.setenv(ENV_VAR, f"before:{POISON}")
    llm = LLM(model=model_path, **ENGINE)
    llm.generate(GOOD[:1], GREEDY, use_tqdm=False)
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        with pytest.raises(RequestFailedError):
            llm.generate([BAD], GREEDY, use_tqdm=False)
    # A successful step in between resets the count.
    llm.generate(GOOD[:1], GREEDY, use_tqdm=False)
    assert core_stats(llm)["num_consecutive"] == 0
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        with pytest.raises(RequestFailedError):
            llm.generate([BAD], GREEDY, use_tqdm=False)
    with pytest.raises(EngineStepsFailedError, match=f"{MAX_CONSECUTIVE_STEP_FAILURES} model "
                                                      "steps in a row raised"):
        llm.generate([BAD], GREEDY, use_tqdm=False)
    assert core_stats(llm)["num_failed_steps"] == 2 * MAX_CONSECUTIVE_STEP_FAILURES - 1
    assert_idle_and_consistent(llm)  # the failed requests were still cleaned up


def test_tensor_parallel_worker_error_stops_the_engine(monkeypatch, model_path) -> None:
    """A rank that raises cannot be recovered (its peers may sit in a collective): the engine
    raises WorkerFailedError at once instead of failing requests and hanging."""
    monkeypatch.setenv(ENV_VAR, f"forward:{POISON}")
    llm = LLM(model=model_path, tensor_parallel_size=2, **ENGINE)
    try:
        assert tokens(llm.generate(GOOD[:2], GREEDY, use_tqdm=False))  # healthy before
        executor = llm.llm_engine.engine_core.executor
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match="tensor-parallel worker rank . failed"):
            llm.generate([GOOD[2], BAD], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
        assert all(not p.is_alive() for p in executor.procs)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("stage", ["before", "forward"])
def test_failed_step_leaves_no_prefix_cache_hit(monkeypatch, model_path, stage) -> None:
    """A failed step hashed the full blocks of the prompt it admitted, but never wrote their
    K/V: the retried prompt must not hit them (it would read what the blocks held before,
    here another prompt's K/V) and gives exactly the tokens of a fresh engine."""
    small = dict(ENGINE, max_model_len=128, num_gpu_blocks_override=8)  # 8 blocks of 16
    other = {"prompt_token_ids": [50 + i % 40 for i in range(120)]}  # fills all 8 blocks
    retried = GOOD[1]  # 36 tokens: 2 full blocks a retry would hit
    fresh = tokens(LLM(model=model_path, **small).generate([retried], GREEDY, use_tqdm=False))

    monkeypatch.setenv(ENV_VAR, f"{stage}:{POISON}")
    llm = LLM(model=model_path, **small)
    llm.generate([other], GREEDY, use_tqdm=False)  # every block now holds its K/V
    with pytest.raises(RequestFailedError):
        llm.generate([retried, BAD], GREEDY, use_tqdm=False)  # one step admits both, fails
    assert_idle_and_consistent(llm)
    assert tokens(llm.generate([retried], GREEDY, use_tqdm=False)) == fresh
    stats = llm.llm_engine.engine_core.make_stats()
    assert stats.prefix_cache_hits == 0  # no full block of it was ever computed before
