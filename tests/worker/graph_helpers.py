"""Shared by the CUDA-graph tests: the engine's decode through a GraphRunner that runs its
padded static buffers eagerly (CPU), against the engine's normal eager path."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import AttentionMetadata
from pagellm.forward_context import set_forward_context
from pagellm.worker.cuda_graphs import GraphRunner, bucket_for, capture_sizes


def attach_eager_graph_runner(llm: LLM) -> GraphRunner:
    """Give a CPU engine's runner a GraphRunner that runs the padded buffers eagerly."""
    runner = llm.llm_engine.engine_core.executor.runner
    cfg = runner.config
    graphs = GraphRunner(
        runner.model, runner.kv_caches, capture_sizes(cfg.scheduler.max_num_seqs),
        max_model_len=cfg.scheduler.max_model_len, block_size=cfg.cache.block_size,
        null_block_id=runner.num_blocks, scratch_block_id=runner.num_blocks + 1,
        hidden_size=cfg.model.hf_config.hidden_size, dtype=runner.dtype, device=runner.device,
        use_cuda_graphs=False)
    graphs.capture()  # a no-op without CUDA graphs
    runner.graph_runner = graphs
    return graphs


def generate_shrinking_batch(llm: LLM, n: int, seed: int = 0):
    """n prompts at once with max_tokens 2..n+1: decode steps of n, n-1, ..., 1 sequences."""
    rng = random.Random(seed)
    vocab = llm.llm_engine.config.model.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True, logprobs=0)
              for i in range(n)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs


def assert_same_decoding(llm: LLM, n: int) -> GraphRunner:
    runner = llm.llm_engine.engine_core.executor.runner
    assert runner.graph_runner is None  # CPU: the engine itself never builds one
    want_tokens, want_lp = generate_shrinking_batch(llm, n)
    graphs = attach_eager_graph_runner(llm)
    try:
        got_tokens, got_lp = generate_shrinking_batch(llm, n)
    finally:
        runner.graph_runner = None
    assert got_tokens == want_tokens
    for got, want in zip(got_lp, want_lp, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    return graphs


class Step:
    """Three decode sequences with shuffled blocks in a cache whose unowned blocks hold NaN."""

    def __init__(self, runner, context_lens: tuple[int, ...], seed: int) -> None:
        bs = runner.config.cache.block_size
        null = runner.num_blocks
        rng = random.Random(seed)
        free = list(range(null))
        rng.shuffle(free)
        self.slots, self.tables, lens = [], [], []
        for ctx in context_lens:
            table = [free.pop() for _ in range(ctx // bs + 1)]
            self.tables.append(table)
            self.slots.append(table[ctx // bs] * bs + ctx % bs)
            lens.append(ctx + 1)
        width = max(map(len, self.tables))
        bt = torch.full((len(lens), width), null, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            bt[i, : len(t)] = torch.tensor(t)
        n = len(lens)
        self.meta = AttentionMetadata(
            num_tokens=n, num_seqs=n, slot_mapping=torch.tensor(self.slots),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=bt, max_query_len=1,
            max_seq_len=max(lens), query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=lens,
            is_decode_only=True, padding_is_zero=True)
        self.input_ids = torch.tensor([rng.randrange(3, 300) for _ in lens])
        self.positions = torch.tensor(context_lens)
        # Blocks no sequence owns hold NaN; owned blocks hold random K/V up to the new token and
        # zeros after it (the runner's contract); the null block is zero.
        owned = {b for t in self.tables for b in t}
        self.kv = []
        g = torch.Generator().manual_seed(seed)
        for k, _ in runner.kv_caches:
            layer = []
            for _ in range(2):
                c = torch.full_like(k, float("nan"))
                flat = c.view(-1, *k.shape[2:])
                for t, ctx in zip(self.tables, context_lens, strict=True):
                    pos = torch.arange(len(t) * bs)
                    s = torch.tensor(t).repeat_interleave(bs) * bs + pos % bs
                    flat[s] = torch.randn(len(s), *k.shape[2:], generator=g) * (pos <= ctx)[
                        :, None, None]
                c[null] = 0
                layer.append(c)
            self.kv.append(tuple(layer))
        self.owned = owned

    def clone_kv(self):
        return [(k.clone(), v.clone()) for k, v in self.kv]


def check_padded_step(runner, bucket_sizes: list[int]) -> None:
    """One step of 3 sequences in a NaN-filled cache, padded (or not) to a bucket, against the
    unpadded forward: same outputs, finite padding rows, only real slots and scratch written."""
    cfg = runner.config
    step = Step(runner, (5, 17, 40), seed=1)
    ref_kv = step.clone_kv()
    with torch.inference_mode(), set_forward_context(step.meta, ref_kv):
        want = runner.model(step.input_ids, step.positions)
    pad_kv = step.clone_kv()
    graphs = GraphRunner(
        runner.model, pad_kv, bucket_sizes, max_model_len=cfg.scheduler.max_model_len,
        block_size=cfg.cache.block_size, null_block_id=runner.num_blocks,
        scratch_block_id=runner.num_blocks + 1, hidden_size=cfg.model.hf_config.hidden_size,
        dtype=runner.dtype, device=runner.device, use_cuda_graphs=False)
    with torch.inference_mode():
        got = graphs.run(step.input_ids, step.positions, step.meta)
    bucket = bucket_for(sorted(bucket_sizes), 3)
    assert graphs.num_steps == {bucket: 1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(graphs.output[:bucket]).all()  # padding rows too: nothing can leak
    scratch = runner.num_blocks + 1
    for (k0, v0), (kr, vr), (kp, vp) in zip(step.kv, ref_kv, pad_kv, strict=True):
        for before, ref, pad in ((k0, kr, kp), (v0, vr, vp)):
            # Every block but the scratch one equals the unpadded run (NaN included).
            torch.testing.assert_close(pad[:scratch], ref[:scratch], rtol=1e-5, atol=1e-5,
                                       equal_nan=True)
            assert (pad[runner.num_blocks] == 0).all()  # the null block stays zero
            if bucket > 3:  # the padding rows wrote their K/V into the scratch block only
                assert not torch.equal(pad[scratch].nan_to_num(7.0),
                                       before[scratch].nan_to_num(7.0))
            else:
                assert torch.equal(pad[scratch].isnan(), before[scratch].isnan())


class HostSyncRecorder(TorchDispatchMode):
    """Records ops that read tensor data on the host (.item(), bool(), int()) or build tensors
    from host values (torch.tensor): neither may happen inside a CUDA graph capture."""

    # Under inference mode .item() and bool() dispatch as item / is_nonzero, not decomposed.
    FORBIDDEN = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal",
                 "aten.lift_fresh")

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.FORBIDDEN):
            self.bad.append(str(func))
        return func(*args, **(kwargs or {}))


def assert_no_host_syncs(llm: LLM, size: int) -> None:
    """The region a graph captures, run for one bucket, reads no tensor data on the host."""
    runner = llm.llm_engine.engine_core.executor.runner
    graphs = attach_eager_graph_runner(llm)
    runner.graph_runner = None
    with torch.inference_mode(), HostSyncRecorder() as rec:
        graphs._forward(size)
    assert rec.bad == []
