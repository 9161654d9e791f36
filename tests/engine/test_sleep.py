"""``LLM.sleep``/``wake_up``/``is_sleeping`` (sleep mode, vLLM's names): the KV cache's memory
(and at level 2 the weights') goes back to the system, and after waking greedy outputs are the
same as before; without ``enable_sleep_mode`` sleeping is an error naming the flag."""

from __future__ import annotations

import pytest
from weight_update_utils import prompts, tokens

from pagellm import LLM, SamplingParams
from pagellm.errors import EngineSleepingError


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def engine(path, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_model_len": 256,
          "enable_sleep_mode": True, "enable_prefix_caching": True, **kw}
    return LLM(model=str(path), **kw)


def kv_bytes(llm: LLM) -> int:
    kv = llm.llm_engine.engine_core.executor.runner.kv_caches[0][0]._base
    return kv.numel() * kv.element_size()


@pytest.mark.parametrize("level", [1, 2])
def test_outputs_same_after_wake(tiny_llama_dir, level) -> None:
    llm = engine(tiny_llama_dir)
    ps = prompts(llm.llm_engine.config.model.vocab_size)
    before = tokens(llm, ps)
    assert not llm.is_sleeping()
    llm.sleep(level=level)
    assert llm.is_sleeping()
    runner = llm.llm_engine.engine_core.executor.runner
    assert runner.kv_caches == [] and runner.graph_runner is None
    assert (runner.model is None) == (level == 2)
    with pytest.raises(EngineSleepingError, match="wake_up"):
        tokens(llm, ps)
    llm.wake_up()
    assert not llm.is_sleeping()
    # The same prompts: their blocks were cached before the sleep and must not be reused.
    assert tokens(llm, ps) == before
    # Twice round, and level 2 after level 1.
    llm.sleep(level=1)
    llm.sleep(level=2)
    llm.wake_up()
    assert tokens(llm, ps) == before


def _accepted(llm: LLM) -> int:
    stats = llm.llm_engine.engine_core.make_stats().spec_decoding
    assert stats is not None
    return stats.num_accepted_tokens


@pytest.mark.parametrize("level", [1, 2])
def test_draft_model_sleeps_with_the_target(tiny_llama_dir, level) -> None:
    """Speculative decoding's draft model frees its cache (and at level 2 its weights) too;
    after waking it drafts again, the outputs unchanged."""
    # The target as its own draft: its greedy drafts are accepted, so acceptance shows it ran.
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    llm = engine(tiny_llama_dir, speculative_config=spec)
    ps = prompts(llm.llm_engine.config.model.vocab_size)
    before = tokens(llm, ps)
    accepted = _accepted(llm)
    assert accepted > 0
    proposer = llm.llm_engine.engine_core.executor.runner.spec_decode.proposer
    assert proposer.kv_caches
    llm.sleep(level=level)
    assert proposer.kv_caches == []
    assert (proposer.model is None) == (level == 2)
    llm.wake_up()
    assert proposer.kv_caches and proposer.model is not None
    assert tokens(llm, ps) == before
    assert _accepted(llm) > accepted


@pytest.mark.parametrize("level", [1, 2])
def test_rss_falls(tiny_llama_dir, level) -> None:
    llm = engine(tiny_llama_dir, kv_cache_memory="256MiB")
    ps = prompts(llm.llm_engine.config.model.vocab_size)
    before = tokens(llm, ps)
    # The pool is allocated untouched (pages come as blocks are used): touch all of it, as a
    # long rollout would.
    llm.collective_rpc(lambda r: r.kv_caches[0][0]._base.fill_(0))
    kv = kv_bytes(llm)
    assert kv >= 200 * 2**20
    rss = rss_bytes()
    llm.sleep(level=level)
    fell = rss - rss_bytes()
    assert fell >= 0.8 * kv, (fell, kv)
    llm.wake_up()
    assert tokens(llm, ps) == before


def test_needs_the_flag(tiny_llama_dir) -> None:
    llm = engine(tiny_llama_dir, enable_sleep_mode=False)
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        llm.sleep()
    with pytest.raises(RuntimeError, match="enable-sleep-mode"):
        llm.wake_up()
    assert not llm.is_sleeping()


def test_refused_with_requests_in_flight(tiny_llama_dir) -> None:
    llm = engine(tiny_llama_dir)
    eng = llm.llm_engine
    eng.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle"):
        llm.sleep()
    assert not llm.is_sleeping()
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    eng.abort_request("r")
    llm.sleep()
    llm.wake_up()  # and twice is harmless
    llm.wake_up()
