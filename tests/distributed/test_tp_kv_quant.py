"""An 8-bit KV cache (--kv-cache-dtype int8_per_token_head) with tensor_parallel_size=2 (CPU,
gloo): each rank quantizes its own K/V heads (and keeps their scales); greedy tokens equal the
one-rank engine's with the same KV dtype, under chunked prefill and preemption, and again after
sleep/wake (the scales are freed and rebuilt with the cache)."""

from __future__ import annotations

from tp_utils import ENGINE, prompts, run, tp2_llm

from pagellm import LLM, SamplingParams


def cache_shape(runner) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    quant = runner.kv_quant
    scales = None if not quant else tuple(quant[0].k_scales.shape)
    return tuple(runner.kv_caches[0][0].shape) if runner.kv_caches else (), scales


def test_tp2_int8_kv_matches_tp1(tiny_llama_dir) -> None:
    kv = "int8_per_token_head"
    one = LLM(model=str(tiny_llama_dir), kv_cache_memory="32MiB", kv_cache_dtype=kv, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ps = prompts(8, one.llm_engine.config.model.vocab_size, seed=3)
    want = [o.outputs[0].token_ids for o in run(one, ps, params)]
    llm = tp2_llm(tiny_llama_dir, kv_cache_dtype=kv, enable_sleep_mode=True)
    try:
        assert [o.outputs[0].token_ids for o in run(llm, ps, params)] == want
        assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0
        heads = one.llm_engine.config.model.num_kv_heads // 2  # each rank's share
        (values, scales), _ = llm.collective_rpc(cache_shape)
        assert values[-2:] == (heads, one.llm_engine.config.model.head_dim)
        assert scales is not None and scales[-1] == heads
        llm.sleep(level=1)
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in run(llm, ps, params)] == want
    finally:
        llm.llm_engine.shutdown()
