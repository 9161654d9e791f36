"""The whole engine on tiny hybrid models (Gated DeltaNet: Qwen3-Next, Qwen3.5; Mamba-2: Granite
4, Nemotron-H): greedy tokens against transformers, invariance under batching, chunked prefill
and preemption (the recurrent state recomputed), state slots all back at idle, prefix hits on
state snapshots, prompt logprobs, structured output and the refusals."""

from __future__ import annotations

import random

import pytest
import torch

from pagellm import LLM, SamplingParams


def _prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 90) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]}
            for _ in range(n)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def next_path(tiny_model_dir) -> str:
    return str(tiny_model_dir("qwen3-next"))


@pytest.mark.parametrize(("arch", "backend"), [("qwen3-next", "auto"), ("qwen3.5", "auto"),
                                               ("qwen3-next", "torch"), ("granite4", "auto"),
                                               ("nemotron-h", "auto")])
def test_greedy_matches_transformers(tiny_model_dir, arch, backend) -> None:
    """``torch``: the backend that has the runner zero new blocks (recurrent layers have
    none)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
              max_num_batched_tokens=64, attention_backend=backend)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(4, llm.llm_engine.config.model.vocab_size, seed=1, lo=20, hi=150)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, got in zip(prompts, _tokens(outs), strict=True):
        ids = torch.tensor([p["prompt_token_ids"]])
        with torch.no_grad():
            expect = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == expect[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", ["qwen3-next", "granite4", "nemotron-h"])
def test_batch_invariance_under_chunking_and_preemption(tiny_model_dir, arch) -> None:
    next_path = str(tiny_model_dir(arch))
    roomy = LLM(model=next_path, dtype="float32", kv_cache_memory="32MiB", max_model_len=256)
    prompts = _prompts(16, roomy.llm_engine.config.model.vocab_size, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = [_tokens(roomy.generate(p, params, use_tqdm=False))[0] for p in prompts]
    # A 40-token budget chunks most prompts; 24 blocks of 16 tokens cannot hold 16 requests of
    # ~65 tokens at once, so the scheduler preempts and the state is recomputed from tokens.
    tight = LLM(model=next_path, dtype="float32", max_model_len=256, max_num_seqs=16,
                max_num_batched_tokens=40, num_gpu_blocks_override=24)
    together = _tokens(tight.generate(prompts, params, use_tqdm=False))
    core = tight.llm_engine.engine_core
    assert core.make_stats().num_preemptions > 0
    assert together == alone
    kv = core.scheduler.kv_cache_manager
    assert kv.usage == 0.0
    assert kv.state_slots is not None and kv.state_slots.num_free == kv.state_slots.num_slots


def test_state_slots_bound_concurrency(next_path) -> None:
    """Fewer slots than requests: they wait for a slot, nothing is lost or mixed up."""
    llm = LLM(model=next_path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
              max_num_seqs=2)
    core = llm.llm_engine.engine_core
    assert core.scheduler.kv_cache_manager.state_slots.num_slots == 2
    prompts = _prompts(5, llm.llm_engine.config.model.vocab_size, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [_tokens(llm.generate(p, params, use_tqdm=False))[0] for p in prompts]
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == alone


def test_prompt_logprobs_match_transformers(next_path) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(model=next_path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
              max_num_batched_tokens=32)
    ref = AutoModelForCausalLM.from_pretrained(next_path, dtype=torch.float32).eval()
    ids = _prompts(1, llm.llm_engine.config.model.vocab_size, seed=5, lo=70, hi=70)[0]
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([ids["prompt_token_ids"]])).logits[0], -1)
    toks = ids["prompt_token_ids"]
    for i in range(1, len(toks)):
        got = out.prompt_logprobs[i][toks[i]].logprob
        assert abs(got - float(logp[i - 1, toks[i]])) < 1e-4


def test_speculative_decoding_is_refused(next_path) -> None:
    with pytest.raises(ValueError, match="--speculative-config cannot be used with "
                                         "Qwen3NextForCausalLM"):
        LLM(model=next_path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def _conversation(vocab: int, seed: int, turns: int, lo: int = 10, hi: int = 30
                  ) -> list[list[int]]:
    """An agent's turns: each resends the whole history (filled in with the model's answers
    as it goes) plus a new message of ``lo``-``hi`` tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(turns)]


def _run_conversation(llm: LLM, messages: list[list[int]], salt: str | None = None
                      ) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    history: list[int] = []
    answers, cached = [], []
    for message in messages:
        history = history + message
        prompt: dict = {"prompt_token_ids": history}
        if salt is not None:
            prompt["cache_salt"] = salt
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        answers.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
        history = history + list(out.outputs[0].token_ids)
    return answers, cached


@pytest.mark.parametrize("arch", ["qwen3-next", "granite4", "nemotron-h"])
def test_prefix_hits_resume_from_state_snapshots(make_tiny_model, tmp_path, arch) -> None:
    """Multi-turn: every turn after the first resumes from a snapshot of the recurrent state
    (and the KV blocks before it), and answers exactly as a cold engine. Turns of 150-250
    tokens, past the Mamba-2 models' 512-token snapshot interval (their state is larger)."""
    next_path = str(make_tiny_model(tmp_path / arch, arch, max_position_embeddings=2048))
    kw = {"dtype": "float32", "kv_cache_memory": "32MiB", "max_model_len": 2048}
    cold = LLM(model=next_path, **kw)
    warm = LLM(model=next_path, **kw, enable_prefix_caching=True, max_num_batched_tokens=160)
    kv = warm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.snapshots is not None
    messages = _conversation(warm.llm_engine.config.model.vocab_size, seed=6, turns=5,
                             lo=150, hi=250)
    expected, none = _run_conversation(cold, messages)
    got, cached = _run_conversation(warm, messages)
    assert got == expected
    assert none == [0] * 5
    # Each hit reaches the last snapshot within what the turn before computed (its prompt and
    # answer but the answer's last token).
    interval = kv.snapshots.interval_blocks * kv.block_size
    history, expected_hits = 0, [0]
    for message in messages[:-1]:
        history += len(message) + 12
        expected_hits.append((history - 1) // interval * interval)
    assert cached == expected_hits, (cached, interval)
    assert sum(cached) > 0
    # Another tenant sending the last turn's whole prompt hits nothing of the first one's;
    # the same tenant (no salt) hits as much as the conversation's last turn did.
    last = [t for m, a in zip(messages[:-1], got[:-1], strict=True) for t in m + a]
    last += messages[-1]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    other = warm.generate({"prompt_token_ids": last, "cache_salt": "tenant-b"}, params,
                          use_tqdm=False)[0]
    same = warm.generate({"prompt_token_ids": last}, params, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens >= cached[-1] > 0
    assert kv.state_slots.num_free == kv.state_slots.num_slots


def test_same_prompt_in_one_batch_and_async_scheduling(next_path) -> None:
    """Identical prompts admitted together (one may find the other's snapshots reserved but
    not yet written: it must not resume from them), with async scheduling: cold tokens."""
    cold = LLM(model=next_path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    warm = LLM(model=next_path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
               enable_prefix_caching=True, async_scheduling=True, max_num_batched_tokens=64)
    prompt = _prompts(1, cold.llm_engine.config.model.vocab_size, seed=7, lo=150, hi=150)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = _tokens(cold.generate(prompt, params, use_tqdm=False))
    for _ in range(2):  # second round: hits on the first round's snapshots
        assert _tokens(warm.generate([prompt] * 3, params, use_tqdm=False)) == expected * 3
    assert warm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits > 0


def test_structured_output_constrains_a_hybrid_model(next_path) -> None:
    """The grammar bitmask applies to a hybrid model's logits as to any other's."""
    import re

    from pagellm import StructuredOutputsParams

    llm = LLM(model=next_path, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="(ab|cd){3}"))
    outs = llm.generate(["hello", "world"], params, use_tqdm=False)
    for out in outs:
        assert re.fullmatch("(ab|cd){3}", out.outputs[0].text), out.outputs[0].text
