"""Clear errors: a --tensor-parallel-size the model or machine cannot take is refused before any
process starts; a worker that dies makes the engine raise, naming the rank, within seconds, and
leaves no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from tp_utils import pid_alive, prompts, tp2_llm

from pagellm import LLM, SamplingParams
from pagellm.config import check_tensor_parallel
from pagellm.errors import WorkerFailedError

DEATH_NOTICE_S = 10.0  # "within seconds", with room for a loaded CI machine


def test_size_not_dividing_the_heads_is_refused(tiny_model_dir) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 .*num_attention_heads \(4\)"
                                         r".*Valid sizes: 1, 2, 4"):
        LLM(model=str(tiny_model_dir("llama")), dtype="float32", tensor_parallel_size=3)
    assert time.monotonic() - start < 30  # refused up front, not after starting workers


def test_kv_heads_neither_dividing_nor_divided_are_refused(make_tiny_config) -> None:
    cfg = make_tiny_config("llama", num_attention_heads=12, num_key_value_heads=6,
                           hidden_size=96, intermediate_size=192)
    cpu = torch.device("cpu")
    check_tensor_parallel(2, cfg, cpu, "cpu")  # 6 KV heads split 3 per rank
    check_tensor_parallel(12, cfg, cpu, "cpu")  # 6 KV heads, each on two ranks
    with pytest.raises(ValueError, match=r"num_key_value_heads \(6\).*Valid sizes: 1, 2, 3, 6, "
                                         r"12"):
        check_tensor_parallel(4, cfg, cpu, "cpu")


def test_more_ranks_than_gpus_is_refused(make_tiny_config) -> None:
    cfg = make_tiny_config("llama")
    cuda = torch.device("cuda")
    check_tensor_parallel(2, cfg, cuda, "cuda", num_cuda_devices=2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 needs 4 GPUs .* 2 CUDA"):
        check_tensor_parallel(4, cfg, cuda, "cuda", num_cuda_devices=2)
    with pytest.raises(ValueError, match="--device cuda:1 with --tensor-parallel-size 2"):
        check_tensor_parallel(2, cfg, cuda, "cuda:1", num_cuda_devices=2)




def _wait_all_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_worker_killed_mid_generation(tiny_model_dir) -> None:
    llm = tp2_llm(tiny_model_dir("llama"), max_num_batched_tokens=64, max_num_seqs=16,
                  num_gpu_blocks_override=None)
    executor = llm.llm_engine.engine_core.executor
    pids = [p.pid for p in executor.procs]
    vocab = llm.llm_engine.config.model.vocab_size
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    killed_at: list[float] = []

    def kill_rank1() -> None:
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    steps = 0
    try:
        threading.Thread(target=kill_rank1, daemon=True).start()
        with pytest.raises(WorkerFailedError, match=r"rank 1 \(pid \d+\) died.*exit code -9"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # keep the engine busy until it fails
                if not engine.has_unfinished_requests():
                    for i, p in enumerate(prompts(8, vocab, seed=steps)):
                        engine.add_request(f"{steps}-{i}", p, params)
                engine.step()
                steps += 1
        assert killed_at and time.monotonic() - killed_at[0] < DEATH_NOTICE_S
        assert steps > 1  # it was really generating when the worker died
        assert _wait_all_gone(pids, 10)  # rank 0, stuck in a collective, was stopped too
        with pytest.raises(WorkerFailedError, match="rank 1"):  # and the engine stays failed
            engine.step()
    finally:
        engine.shutdown()


def test_worker_killed_while_idle(tiny_model_dir) -> None:
    llm = tp2_llm(tiny_model_dir("llama"), num_gpu_blocks_override=None)
    executor = llm.llm_engine.engine_core.executor
    pids = [p.pid for p in executor.procs]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        assert llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
        os.kill(pids[0], signal.SIGKILL)
        # The watchdog notices with no engine call and stops the other rank.
        assert _wait_all_gone(pids, DEATH_NOTICE_S)
        assert "rank 0" in (executor._failure or "")
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"rank 0 \(pid \d+\) died"):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
        assert time.monotonic() - start < 1.0
    finally:
        llm.llm_engine.shutdown()
