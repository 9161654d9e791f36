"""``LLM.sleep``/``wake_up`` with tensor_parallel_size=2 (CPU, gloo): every rank frees its KV
cache (and weights) and rebuilds it; greedy outputs are then the same as before."""

from __future__ import annotations

import pytest
from tp_utils import tp2_llm
from weight_update_utils import prompts, tokens


def state(runner) -> tuple[int, bool, bool]:
    return runner.sleep_level, bool(runner.kv_caches), runner.model is not None


@pytest.mark.parametrize("level", [1, 2])
def test_tp2_sleep_wake(tiny_llama_dir, level) -> None:
    llm = tp2_llm(tiny_llama_dir, enable_prefix_caching=True, enable_sleep_mode=True)
    try:
        ps = prompts(llm.llm_engine.config.model.vocab_size, n=3)
        before = tokens(llm, ps)
        llm.sleep(level=level)
        assert llm.collective_rpc(state) == [(level, False, level == 1)] * 2
        llm.wake_up()
        assert llm.collective_rpc(state) == [(0, True, True)] * 2
        assert tokens(llm, ps) == before
    finally:
        llm.llm_engine.shutdown()
