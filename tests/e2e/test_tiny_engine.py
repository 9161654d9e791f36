"""The whole engine on tiny random models: greedy tokens against transformers, and invariance of
greedy and seeded output under batching, chunking and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 90) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]}
            for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2", "mistral"])
def test_greedy_matches_transformers(tiny_model_dir, arch) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(4, llm.llm_engine.config.model.vocab_size, seed=1, hi=40)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for p, got in zip(prompts, _tokens(outs), strict=True):
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            expect = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == expect[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def roomy_llm(tiny_path) -> LLM:
    return LLM(model=tiny_path, dtype="float32", kv_cache_memory="32MiB", max_model_len=256)


def test_batch_invariance_under_chunking_and_preemption(tiny_path, roomy_llm) -> None:
    vocab = roomy_llm.llm_engine.config.model.vocab_size
    prompts = _prompts(32, vocab, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [_tokens(roomy_llm.generate(p, params, use_tqdm=False))[0] for p in prompts]
    # A 48-token budget chunks most prompts; 40 blocks of 16 tokens cannot hold 32 requests of
    # ~70 tokens at once, so the scheduler must preempt and recompute.
    tight = LLM(model=tiny_path, dtype="float32", max_model_len=256, max_num_seqs=32,
                max_num_batched_tokens=48, num_gpu_blocks_override=40)
    together = _tokens(tight.generate(prompts, params, use_tqdm=False))
    core = tight.llm_engine.engine_core
    assert core.make_stats().num_preemptions > 0
    assert together == alone
    # At idle every block is back in the pool.
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.scheduler.kv_cache_manager.block_pool.check_invariants()


def test_seeded_sampling_is_batch_invariant(roomy_llm) -> None:
    vocab = roomy_llm.llm_engine.config.model.vocab_size
    prompts = _prompts(6, vocab, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=12,
                             ignore_eos=True) for i in range(6)]
    alone = [_tokens(roomy_llm.generate(p, sp, use_tqdm=False))[0]
             for p, sp in zip(prompts, params, strict=True)]
    together = _tokens(roomy_llm.generate(prompts, params, use_tqdm=False))
    assert together == alone
    # Other seeds give other samples.
    other = _tokens(roomy_llm.generate(prompts[0], params[0].clone(seed=999), use_tqdm=False))[0]
    assert other != alone[0]


def test_top_k_1_equals_greedy(roomy_llm) -> None:
    vocab = roomy_llm.llm_engine.config.model.vocab_size
    prompts = _prompts(4, vocab, seed=4)
    greedy = _tokens(roomy_llm.generate(prompts, GREEDY, use_tqdm=False))
    topk1 = _tokens(roomy_llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1,
                                                               max_tokens=10, ignore_eos=True),
                                       use_tqdm=False))
    assert topk1 == greedy


def test_logprobs_are_raw_log_softmax(tiny_path, roomy_llm) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    prompt = _prompts(1, roomy_llm.llm_engine.config.model.vocab_size, seed=5)[0]
    out = roomy_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=5,
                                                    ignore_eos=True), use_tqdm=False)[0]
    comp = out.outputs[0]
    ids = prompt["prompt_token_ids"] + comp.token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0].double()
    n = len(prompt["prompt_token_ids"])
    total = 0.0
    for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        expect = torch.log_softmax(logits[n - 1 + step], -1)
        assert entry[tok].rank == 1  # greedy picks the top token
        assert len(entry) == 5
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(expect[tid].item(), abs=1e-4)
        total += expect[tok].item()
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_max_model_len_that_cannot_fit_fails_at_start(tiny_path) -> None:
    with pytest.raises(ValueError, match=r"--max-model-len 256 does not fit.*Lower --max-model"):
        LLM(model=tiny_path, dtype="float32", max_model_len=256, num_gpu_blocks_override=8)


def test_bad_prompts_are_rejected(roomy_llm) -> None:
    with pytest.raises(ValueError, match="empty"):
        roomy_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        roomy_llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        roomy_llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)
    # Nothing was left behind in the engine.
    assert not roomy_llm.llm_engine.has_unfinished_requests()
