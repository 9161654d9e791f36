"""Helpers for the tensor-parallel tests: engines, prompts and the expected per-rank bytes.

The expected bytes follow the Megatron rules from the checkpoint's own tensor shapes (not from
our layers): norms replicated; q, gate, up, o, down split 1/N; K/V split by heads, one head per
rank when N exceeds them; embedding and LM head split by vocabulary rows, ceil(V/N) per rank.
"""

from __future__ import annotations

import glob
import math
import os
import random
from pathlib import Path

from safetensors import safe_open

from pagellm import LLM, SamplingParams

ENGINE = dict(dtype="float32", max_model_len=256, seed=0)


def prompts(n: int, vocab: int, seed: int, lo: int = 5, hi: int = 70) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]}
            for _ in range(n)]


def tp1_llm(path: Path) -> LLM:
    return LLM(model=str(path), kv_cache_memory="32MiB", **ENGINE)


def tp2_llm(path: Path, **overrides) -> LLM:
    """A two-rank engine with a small token budget and few KV blocks: prompts are chunked and
    requests preempted, so every SchedulerOutput field crosses the broadcast."""
    kw = dict(ENGINE, kv_cache_memory="32MiB", tensor_parallel_size=2,
              max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=24)
    kw.update(overrides)
    return LLM(model=str(path), **kw)


def run(llm: LLM, ps: list[dict], params: SamplingParams | list[SamplingParams]):
    return llm.generate(ps, params, use_tqdm=False)


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in glob.glob(str(path / "*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def expected_rank_bytes(path: Path, config, rank: int, tp: int, dtype_bytes: int = 4
                        ) -> tuple[int, int]:
    """(parameter bytes held, checkpoint bytes read) by ``rank`` of ``tp``."""
    kv = config.num_key_value_heads
    vocab = config.vocab_size
    rows = math.ceil(vocab / tp)
    held = read = 0
    for name, shape in checkpoint_shapes(path).items():
        n = math.prod(shape)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # the LM head is the embedding: a stored copy is skipped, never read
        if "norm" in name:
            h = r = n
        elif ".k_proj." in name or ".v_proj." in name:
            h = r = n * max(1, kv // tp) // kv
        elif "embed_tokens" in name or name == "lm_head.weight":
            h = rows * shape[1]
            r = (min(vocab, (rank + 1) * rows) - rank * rows) * shape[1]
        else:  # q/o/gate/up/down weights, q bias
            h = r = n // tp
        held += h
        read += r
    return held * dtype_bytes, read * dtype_bytes


def checkpoint_bytes(path: Path, dtype_bytes: int = 4) -> int:
    return sum(math.prod(s) for s in checkpoint_shapes(path).values()) * dtype_bytes


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie still answers kill(0) but has exited all the same."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"
