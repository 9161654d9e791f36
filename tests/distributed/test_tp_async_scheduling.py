"""Async scheduling with tensor_parallel_size=2 (two worker processes, gloo on CPU): step N+1
goes out through the broadcast ring before rank 0's reply for step N is read, and the tokens
equal the one-rank synchronous engine's, under chunked prefill and preemption."""

from __future__ import annotations

from tp_utils import prompts, run, tp1_llm, tp2_llm

from pagellm import SamplingParams


def test_greedy_and_seeded_tokens_match_tp1_sync(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    tp1 = tp1_llm(path)
    vocab = tp1.llm_engine.config.model.vocab_size
    ps = prompts(10, vocab, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=1.0, seed=i, max_tokens=12 + 4 * i,
                             logit_bias={2: 2.0})  # EOS (id 2) now and then
              for i in range(len(ps))]
    want = run(tp1, ps, params)
    tp2 = tp2_llm(path, async_scheduling=True)
    try:
        got = run(tp2, ps, params)
        core = tp2.llm_engine.engine_core
        assert core.make_stats().num_preemptions > 0  # 24 blocks: preemption is exercised
        assert not core.has_unfinished_requests()
        assert core.scheduler.kv_cache_manager.get_num_free_blocks() == core.num_blocks
    finally:
        tp2.llm_engine.shutdown()
    assert [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in got] == \
        [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in want]
