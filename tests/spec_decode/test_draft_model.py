"""The draft-model proposer (pagellm/spec_decode/draft_model.py) on tiny random-weight models:
its drafts are transformers' greedy continuation of each request's known tokens, call after call,
whatever the previous drafts' fate; a draft that cannot share the tokenizer is refused."""

from __future__ import annotations

import pytest
import torch

from pagellm.engine_args import EngineArgs
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.draft_model import DraftModelProposer
from pagellm.worker.input_batch import InputBatch

K = 4
BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256


def spec_config(model: str, k: int = K):
    from pagellm.spec_decode.config import SpeculativeConfig

    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=model)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, make_tiny_model):
    # Another seed than the target's: the draft's weights are its own.
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1)


@pytest.fixture(scope="module")
def reference(draft_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        draft_dir, dtype=torch.float32, attn_implementation="eager",
        local_files_only=True).eval()
    ref.generation_config.eos_token_id = None
    return ref


def hf_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                           dtype=torch.long), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def engine_config(target_dir, attention_backend: str = "auto"):
    return EngineArgs(model=str(target_dir), dtype="float32", device="cpu",
                      max_model_len=MAX_MODEL_LEN, max_num_seqs=8, block_size=BLOCK_SIZE,
                      kv_cache_memory="16MiB",
                      attention_backend=attention_backend).create_engine_config()


class Harness:
    """A persistent batch whose requests own disjoint blocks, as the scheduler would give."""

    def __init__(self, proposer: DraftModelProposer, vocab_size: int) -> None:
        self.proposer = proposer
        self.batch = InputBatch(8, MAX_MODEL_LEN, BLOCK_SIZE, vocab_size, samples=False)
        proposer.initialize(NUM_BLOCKS)
        self.batch.set_null_block(NUM_BLOCKS)
        self.next_block = 0

    def add(self, req_id: str, prompt: list[int], num_slots: int) -> None:
        n = -(-num_slots // BLOCK_SIZE)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.batch.add_request(req_id, prompt, [], SamplingParams(max_tokens=64), blocks,
                               len(prompt), None)

    def known(self, req_id: str) -> list[int]:
        s = self.batch.requests[req_id]
        return self.batch.token_ids[s.row, : s.num_tokens].tolist()

    def propose(self, req_ids: list[str], k: int = K) -> dict[str, list[int]]:
        states = [self.batch.requests[r] for r in req_ids]
        return dict(zip(req_ids, self.proposer.propose(self.batch, states, k), strict=True))

    def accept(self, req_id: str, tokens: list[int]) -> None:
        for t in tokens:
            self.batch.append_token(self.batch.requests[req_id], t)


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
def test_drafts_are_the_draft_models_greedy_tokens(tiny_llama_dir, draft_dir, reference,
                                                   attention_backend):
    config = engine_config(tiny_llama_dir, attention_backend)
    proposer = DraftModelProposer(config, spec_config(str(draft_dir)), torch.device("cpu"),
                                  torch.float32)
    assert proposer.num_lookahead_slots == K
    vocab = config.model.vocab_size
    h = Harness(proposer, vocab)
    # Lengths around block boundaries; enough slots for three rounds.
    lengths = {"a": 5, "b": 16, "c": 33}
    for i, (req_id, n) in enumerate(lengths.items()):
        h.add(req_id, prompt(n, i, vocab), n + 4 * (K + 1) + K)
    # Per round and request: how many drafts the target accepts (then adds a token of its own,
    # here a fixed one, as a target differing from the draft would).
    fates = [{"a": 2, "b": 0, "c": K}, {"a": K, "b": 1, "c": 0}, {"a": 0, "b": K, "c": 3}]
    forwards: list[list[int]] = []
    run_forward = proposer._forward

    def record(table, rows, num_computed, num_sched, batch, input_ids):
        forwards.append(num_sched.tolist())
        return run_forward(table, rows, num_computed, num_sched, batch, input_ids)

    proposer._forward = record
    for round_ in range(len(fates) + 1):
        forwards.clear()
        drafts = h.propose(list(lengths))
        for req_id, got in drafts.items():
            assert got == hf_greedy(reference, h.known(req_id), K), (round_, req_id)
        if round_ == 0:
            assert forwards == [list(lengths.values())] + [[1, 1, 1]] * (K - 1)
        if round_ == 1:
            # Accepted drafts keep their K/V: the catch-up runs from the first rejected one
            # ("c" accepted all K: its last draft never ran through the draft model).
            assert forwards[0] == [1, 1, 2]
        if round_ < len(fates):
            for req_id, accepted in fates[round_].items():
                h.accept(req_id, drafts[req_id][:accepted] + [7 + round_])


def test_catch_up_in_chunks_and_requests_that_come_and_go(tiny_llama_dir, draft_dir,
                                                          reference):
    config = engine_config(tiny_llama_dir)
    proposer = DraftModelProposer(config, spec_config(str(draft_dir)), torch.device("cpu"),
                                  torch.float32)
    proposer.max_num_batched_tokens = 8  # catch-up forwards of at most 8 tokens
    vocab = config.model.vocab_size
    h = Harness(proposer, vocab)
    h.add("a", prompt(21, 5, vocab), 21 + 2 * (K + 1) + K)
    h.add("b", prompt(3, 6, vocab), 3 + 2 * (K + 1) + K)
    first = h.propose(["a", "b"])
    assert first["a"] == hf_greedy(reference, h.known("a"), K)
    # "a" is preempted (its draft state forgotten) while "b" goes on without drafts for a
    # few steps (speculation off under load): both catch up from where they are.
    proposer.remove_request("a")
    h.accept("a", [9])
    h.accept("b", first["b"][:1] + [11, 12, 13])
    second = h.propose(["b", "a"])
    assert second["a"] == hf_greedy(reference, h.known("a"), K)
    assert second["b"] == hf_greedy(reference, h.known("b"), K)


def test_fewer_drafts_where_the_slots_end(tiny_llama_dir, draft_dir, reference):
    config = engine_config(tiny_llama_dir)
    proposer = DraftModelProposer(config, spec_config(str(draft_dir)), torch.device("cpu"),
                                  torch.float32)
    vocab = config.model.vocab_size
    h = Harness(proposer, vocab)
    h.add("short", prompt(30, 7, vocab), 32)  # two blocks: slots up to position 31
    h.add("full", prompt(32, 8, vocab), 32)  # its next token has no slot yet
    h.add("wide", prompt(10, 9, vocab), 10 + K)
    drafts = h.propose(["short", "full", "wide"])
    # Draft j writes K/V up to position num_tokens + j - 2: "short" gets 3 drafts.
    assert drafts["short"] == hf_greedy(reference, h.known("short"), 3)
    assert drafts["full"] == hf_greedy(reference, h.known("full"), 1)
    assert drafts["wide"] == hf_greedy(reference, h.known("wide"), K)
    h.accept("full", drafts["full"])  # 33 known tokens, 32 slots: nothing to write into
    assert h.propose(["full"]) == {"full": []}
    # Fewer asked than configured.
    assert h.propose(["wide"], 2)["wide"] == hf_greedy(reference, h.known("wide"), 2)


def test_draft_kv_counts_in_the_memory_plan(tiny_llama_dir, draft_dir):
    from pagellm.worker.kv_cache import config_kv_bytes_per_token, plan_for_device

    config = engine_config(tiny_llama_dir)
    proposer = DraftModelProposer(config, spec_config(str(draft_dir)), torch.device("cpu"),
                                  torch.float32)
    target = config_kv_bytes_per_token(config)
    # Same shapes (2 layers, 2 KV heads of 16, fp32): 2 x 2 x 2 x 16 x 4 bytes.
    assert proposer.kv_bytes_per_token == target == 512
    alone = plan_for_device(config, 0, lambda: 0)
    both = plan_for_device(config, 0, lambda: 0,
                           draft_kv_bytes_per_token=proposer.kv_bytes_per_token)
    assert both.num_blocks == alone.num_blocks // 2
    proposer.initialize(both.num_blocks)
    k, v = proposer.kv_caches[0]
    assert k.shape == (both.num_blocks + 2, BLOCK_SIZE, 2, 16)
    assert k.untyped_storage().nbytes() == (both.num_blocks + 2) * BLOCK_SIZE * target


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path, make_tiny_model,
                                                    tiny_tokenizer):
    other = make_tiny_model(tmp_path / "other-vocab", "llama",
                            vocab_size=len(tiny_tokenizer) + 64)
    config = engine_config(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"--speculative-config: key 'model' .*vocabulary"):
        DraftModelProposer(config, spec_config(str(other)), torch.device("cpu"), torch.float32)


def test_a_draft_with_several_kv_cache_groups_is_refused(tiny_llama_dir, tmp_path,
                                                         make_tiny_model):
    # Qwen2 with a window on its later layers only (max_window_layers): two KV cache groups.
    hybrid = make_tiny_model(tmp_path / "hybrid", "qwen2", num_hidden_layers=3,
                             use_sliding_window=True, sliding_window=16, max_window_layers=1)
    config = engine_config(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"--speculative-config: key 'model' .*cache groups"):
        DraftModelProposer(config, spec_config(str(hybrid)), torch.device("cpu"),
                           torch.float32)


# ---- end to end: the engine with a draft model -------------------------------------------------
ENGINE = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 70, (n,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(3, 300, (m,), generator=g).tolist()}
            for m in lengths]


def _tokens(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def _draft_llm(target: str, draft: str, **kwargs):
    from pagellm import LLM

    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "disable_by_batch_size": None}
    return LLM(model=target, speculative_config=spec, **{**ENGINE, **kwargs})


def _check_idle(llm) -> None:
    core = llm.llm_engine.engine_core
    assert core.scheduler.kv_cache_manager.usage == 0.0
    core.scheduler.kv_cache_manager.block_pool.check_invariants()


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    from pagellm import LLM

    return LLM(model=str(tiny_llama_dir), kv_cache_memory="16MiB", **ENGINE)


def test_engine_with_itself_as_draft_accepts_every_draft(tiny_llama_dir, plain):
    target = str(tiny_llama_dir)
    llm = _draft_llm(target, target, kv_cache_memory="16MiB")
    # The same --kv-cache-memory holds both caches: half the blocks of the target alone.
    assert llm.llm_engine.engine_core.num_blocks == plain.llm_engine.engine_core.num_blocks // 2
    prompts = _prompts(6, seed=0)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    for p in prompts[:2]:  # batch 1
        assert _tokens(llm.generate(p, GREEDY, use_tqdm=False)) == \
            _tokens(plain.generate(p, GREEDY, use_tqdm=False))
    stats = llm.llm_engine.engine_core.make_stats().spec_decoding
    # Same weights: the draft's argmax is the target's (its K/V are right at every position).
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens, stats
    _check_idle(llm)


def test_engine_with_another_draft_is_identical(tiny_llama_dir, draft_dir, plain):
    llm = _draft_llm(str(tiny_llama_dir), str(draft_dir), kv_cache_memory="16MiB")
    prompts = _prompts(6, seed=1)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    stats = llm.llm_engine.engine_core.make_stats().spec_decoding
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # another model: some rejected
    _check_idle(llm)


def test_draft_cache_right_through_prefix_hits_preemption_and_chunks(tiny_llama_dir, plain):
    target = str(tiny_llama_dir)
    prompts = _prompts(12, seed=2)
    shared = list(range(100, 150))  # 3 full blocks
    for p in prompts[::2]:
        p["prompt_token_ids"] = shared + p["prompt_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = _tokens(plain.generate(prompts, params, use_tqdm=False))
    # Few blocks (preemption), small steps (chunked prefills and catch-ups), shared prefixes.
    llm = _draft_llm(target, target, max_num_seqs=12, max_num_batched_tokens=48,
                     num_gpu_blocks_override=24, enable_prefix_caching=True)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    again = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(again) == want
    core = llm.llm_engine.engine_core
    stats = core.make_stats()
    assert stats.num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in again)
    # The draft read right K/V everywhere: it still agrees with the target on every draft.
    spec = stats.spec_decoding
    assert spec.num_accepted_tokens >= 0.95 * spec.num_draft_tokens > 0, spec
    _check_idle(llm)
