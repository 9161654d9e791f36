"""``LLM.load_weights`` and ``collective_rpc`` with tensor_parallel_size=2 (CPU, gloo): every
rank loads its shard of the update, and the engine then matches a fresh two-rank engine."""

from __future__ import annotations

import pytest
from tp_utils import tp2_llm
from weight_update_utils import perturbed_model, prompts, tokens


def rank_and_size(runner) -> tuple[int, int]:
    return runner.tp_rank, runner.tp_size


def test_tp2_update_equals_fresh_engine(tiny_llama_dir, tmp_path) -> None:
    weights = perturbed_model(tiny_llama_dir, tmp_path)
    llm = tp2_llm(tiny_llama_dir, enable_prefix_caching=True)
    fresh = None
    try:
        assert llm.collective_rpc(rank_and_size) == [(0, 2), (1, 2)]
        with pytest.raises(AttributeError, match="nope"):
            llm.collective_rpc("nope")  # raised here; the ranks go on
        ps = prompts(llm.llm_engine.config.model.vocab_size, n=3)
        before = tokens(llm, ps)
        assert llm.load_weights(weights.items()) == len(weights)
        after = tokens(llm, ps)
        fresh = tp2_llm(tmp_path)
        assert after == tokens(fresh, ps)
        assert after != before
    finally:
        llm.llm_engine.shutdown()
        if fresh is not None:
            fresh.llm_engine.shutdown()
