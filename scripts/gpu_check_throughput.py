"""gpu_check's `throughput` check: the engine with decode CUDA graphs vs --enforce-eager, each
model and mode in its own process (scripts/gpu_check.py --throughput-worker SPEC)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GPU_CHECK = Path(__file__).with_name("gpu_check.py")
ROOT = GPU_CHECK.parents[1]
DEV = "cuda"  # set by gpu_check.main from --device


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


# Llama-3.2-1B shapes (1.24 B parameters, tied embeddings), random weights.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
THROUGHPUT_BATCHES = (1, 16, 64)
THROUGHPUT_LENS = (128, 64)  # prompt tokens, generated tokens
THROUGHPUT_TIMEOUT_S = 120


def measure_copy_bandwidth(mib: int = 2048, repeats: int = 5) -> float:
    """Device copy bandwidth in bytes/s (read + write) of a ``mib`` MiB tensor, best of n."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    best = math.inf
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def throughput_worker(spec: dict) -> dict:
    """One engine (one model, graphs or eager) in this process: decode figures per batch size."""
    import numpy as np

    from pagellm.benchmarks.latency import decode_weight_bytes, run_batch
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.engine_args import EngineArgs
    from pagellm.worker.kv_cache import config_kv_bytes_per_token

    # The spec's optional keys let the CPU test run this on a tiny model.
    prompt_len, out_len = spec.get("lens", THROUGHPUT_LENS)
    batches = spec.get("batches", THROUGHPUT_BATCHES)
    args = EngineArgs(model=spec["model"], load_format=spec["load_format"],
                      dtype=spec.get("dtype", "bfloat16"), device=DEV,
                      max_model_len=spec.get("max_model_len", 1024), max_num_seqs=max(batches),
                      max_num_batched_tokens=4096, gpu_memory_utilization=0.5,
                      kv_cache_memory=spec.get("kv_cache_memory"),
                      attention_backend=spec.get("attention_backend", "auto"),
                      enforce_eager=spec["eager"])
    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    startup_s = time.perf_counter() - start
    runner = engine.engine_core.executor.runner
    graphs = runner.graph_runner
    weights = decode_weight_bytes(runner.model)[1]
    kv_per_token = config_kv_bytes_per_token(engine.config)
    vocab = engine.config.model.vocab_size
    rng = random.Random(0)
    rows = []
    for batch in batches:
        steps, tokens, seconds = [], 0, 0.0
        for it in range(3):  # the first batch warms up
            prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
            t = run_batch(engine, prompts, out_len, f"b{batch}-{it}")
            if it:
                steps += t.decode_step_s
                tokens += t.num_output_tokens
                seconds += t.latency_s
        step_s = float(np.median(steps))
        kv_read = batch * (prompt_len + out_len / 2) * kv_per_token  # mean context of a step
        rows.append(dict(batch=batch, step_ms=step_s * 1e3, decode_tok_s=batch / step_s,
                         e2e_tok_s=tokens / seconds, bytes_per_step=weights + kv_read))
    engine.shutdown()
    return dict(rows=rows, startup_s=startup_s,
                copy_bw=measure_copy_bandwidth(spec.get("copy_mib", 2048)),
                capture_s=graphs.capture_seconds if graphs else 0.0,
                graph_mib=graphs.graph_memory_bytes / 2**20 if graphs else 0.0,
                reserved_mib=graphs.reserved_bytes / 2**20 if graphs else 0.0,
                graph_steps=dict(graphs.num_steps) if graphs else {})


def _run_throughput(name: str, spec: dict) -> dict:
    cmd = [sys.executable, str(GPU_CHECK), "--throughput-worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=THROUGHPUT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{name}: over {THROUGHPUT_TIMEOUT_S} s") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("THROUGHPUT_JSON ")]
    for ln in proc.stderr.splitlines():  # the engine's start-up log: phases, memory, capture
        if any(k in ln for k in ("Start-up phases", "CUDA graphs", "GPU memory")):
            print(f"    [{name}] {ln.split('] ')[-1]}")
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise AssertionError(f"{name}: worker failed (rc {proc.returncode})")
    return json.loads(lines[-1].removeprefix("THROUGHPUT_JSON "))


def check_throughput() -> None:
    from transformers import LlamaConfig

    from pagellm.models.loader import default_model_path

    tmp = tempfile.mkdtemp(prefix="pagellm-1b-")  # config + tokenizer only: a few MB
    LlamaConfig(**LLAMA_1B).save_pretrained(tmp)
    save_word_tokenizer(tmp, LLAMA_1B["vocab_size"])
    models = [("llama-1b-dummy", dict(model=tmp, load_format="dummy"))]
    try:
        models.append(("default-model", dict(model=default_model_path(), load_format="auto")))
    except Exception as e:
        print(f"  SKIPPED default model: not installed here ({e!r})")
    prompt_len, out_len = THROUGHPUT_LENS
    print(f"  bf16, prompts of {prompt_len} tokens, {out_len} generated; step = median decode "
          "step; BW = (weights + mean K/V) bytes per step / step time")
    for name, spec in models:
        res = {mode: _run_throughput(f"{name} {mode}", dict(spec, eager=mode == "eager"))
               for mode in ("graphs", "eager")}
        g, e = res["graphs"], res["eager"]
        copy_bw = g["copy_bw"]
        print(f"  {name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s; start-up graphs "
              f"{g['startup_s']:.1f} s (capture {g['capture_s']:.1f} s, {g['graph_mib']:.0f} MiB "
              f"measured vs {g['reserved_mib']:.0f} MiB reserved), eager {e['startup_s']:.1f} s")
        for rg, re_ in zip(g["rows"], e["rows"], strict=True):
            line = f"    batch {rg['batch']:3d}"
            for mode, r in (("graphs", rg), ("eager", re_)):
                bw = r["bytes_per_step"] / (r["step_ms"] / 1e3)
                line += (f" | {mode} {r['step_ms']:7.2f} ms/step {r['decode_tok_s']:8.0f} tok/s "
                         f"(e2e {r['e2e_tok_s']:7.0f}) BW {bw / 1e9:5.0f} GB/s "
                         f"{100 * bw / copy_bw:4.1f}% of copy")
            print(line + f" | speed-up {re_['step_ms'] / rg['step_ms']:.2f}x", flush=True)
        assert g["graph_steps"], f"{name}: no decode step ran on a CUDA graph"
