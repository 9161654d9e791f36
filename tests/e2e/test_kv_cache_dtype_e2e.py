"""The engine with an 8-bit KV cache (--kv-cache-dtype) on a tiny random Llama: the cpu
backend's kernels against the torch reference with the same KV dtype, prefix-cache hits and
preemption against cold runs, the memory plan against what was allocated, and refusals."""

from __future__ import annotations

import random

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine_args import EngineArgs
from pagellm.kernels import cpu_ops
from pagellm.worker.kv_cache import config_kv_bytes_per_token, kv_cache_bytes, kv_quant_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
QUANTIZED = ("int8_per_token_head", "fp8", "fp8_e5m2")


def _prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]}
            for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def _llm(path: str, kv: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "16MiB")
    return LLM(model=path, dtype="float32", max_model_len=256, kv_cache_dtype=kv, **kw)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler")
@pytest.mark.parametrize("kv", ["int8_per_token_head", "fp8"])
def test_cpu_kernels_match_torch_reference(tiny_path, kv) -> None:
    cpu = _llm(tiny_path, kv, attention_backend="cpu")
    ref = _llm(tiny_path, kv, attention_backend="torch")
    prompts = _prompts(6, cpu.llm_engine.config.model.vocab_size, seed=1)
    assert _tokens(cpu.generate(prompts, GREEDY, use_tqdm=False)) == \
        _tokens(ref.generate(prompts, GREEDY, use_tqdm=False))
    runner = cpu.llm_engine.engine_core.executor.runner
    assert runner.kv_caches[0][0].element_size() == 1


@pytest.mark.parametrize("kv", QUANTIZED)
def test_prefix_hit_and_preemption_match_cold_run(tiny_path, kv) -> None:
    llm = _llm(tiny_path, kv, enable_prefix_caching=True)
    vocab = llm.llm_engine.config.model.vocab_size
    shared = _prompts(1, vocab, seed=5, lo=40, hi=40)[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]}
               for p in _prompts(6, vocab, seed=6, hi=30)]
    plain = _llm(tiny_path, kv)  # no prefix caching
    cold = [_tokens(plain.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    hot = [_tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts]
    manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert manager.prefix_cache_hits >= 32 * (len(prompts) - 1)
    assert hot == cold
    # Too few blocks for all at once: preempted and recomputed, the same tokens as alone.
    longer = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    many = _prompts(10, vocab, seed=7, lo=30)
    alone = [_tokens(plain.generate(p, longer, use_tqdm=False))[0] for p in many]
    tight = LLM(model=tiny_path, dtype="float32", max_model_len=128, kv_cache_dtype=kv,
                num_gpu_blocks_override=12, max_num_batched_tokens=48, max_num_seqs=10)
    together = _tokens(tight.generate(many, longer, use_tqdm=False))
    assert tight.llm_engine.engine_core.make_stats().num_preemptions > 0
    assert together == alone


@pytest.mark.parametrize("kv", ["auto", *QUANTIZED])
def test_plan_matches_allocation(tiny_path, kv) -> None:
    llm = _llm(tiny_path, kv)
    runner = llm.llm_engine.engine_core.executor.runner
    plan, config = runner.kv_plan, llm.llm_engine.config
    per_token = config_kv_bytes_per_token(config)
    assert plan.kv_bytes_per_token == per_token
    assert plan.num_blocks == 16 * 2**20 // (per_token * config.cache.block_size)
    # The allocation (values, scales, the null and scratch blocks) is what the plan priced.
    allocated = kv_cache_bytes(runner.kv_caches) + kv_quant_bytes(runner.kv_quant)
    assert allocated == (plan.num_blocks + 2) * plan.bytes_per_block


def test_bytes_per_token_about_half_of_bf16(tiny_path) -> None:
    def per_token(kv: str) -> int:
        args = EngineArgs(model=tiny_path, dtype="bfloat16", kv_cache_dtype=kv)
        return config_kv_bytes_per_token(args.create_engine_config())

    bf16 = per_token("auto")
    m = EngineArgs(model=tiny_path).create_engine_config().model
    assert per_token("bfloat16") == bf16
    assert per_token("fp8") == per_token("fp8_e5m2") == bf16 // 2
    # int8 adds a bfloat16 scale per (token, kv head) row, K and V.
    assert per_token("int8_per_token_head") == bf16 // 2 + 2 * m.num_layers * m.num_kv_heads * 2


def test_bad_values_refused_naming_the_flag(tiny_path) -> None:
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineArgs(model=tiny_path, kv_cache_dtype="fp4").create_engine_config()
    # Triton reads 8-bit caches, but a float one only in the model's dtype.
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 is not supported by the "
                                         "Triton attention backend with --dtype float32"):
        EngineArgs(model=tiny_path, dtype="float32", kv_cache_dtype="bfloat16",
                   attention_backend="triton").create_engine_config()


def test_cache_info_label_and_hash_key(tiny_path) -> None:
    from pagellm.metrics.cache_info import cache_config_info

    llm = _llm(tiny_path, "fp8", enable_prefix_caching=True)
    config = llm.llm_engine.config
    assert cache_config_info(config.cache, 1)["cache_dtype"] == "fp8"
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.kv_dtype_key == \
        "kv_dtype=fp8_e4m3"
