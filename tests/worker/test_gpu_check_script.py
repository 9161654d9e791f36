"""scripts/gpu_check.py on CPU: its CLI works, it refuses to run GPU checks without a GPU (saying
why), and the throughput worker's arithmetic holds on a tiny model. The GPU figures themselves
are owed to a GPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=SCRIPT.parents[1])


def test_help_lists_every_check() -> None:
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for name in ("tests", "sweep", "paged", "engine", "bench", "throughput"):
        assert name in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_every_check_is_skipped_with_the_reason() -> None:
    proc = _run("--only", "throughput,engine")
    assert proc.returncode == 2
    assert "skipped" in proc.stdout and "CUDA" in proc.stdout
    bad = _run("--only", "throughput,nope")
    assert bad.returncode == 2 and "unknown check 'nope'" in bad.stderr


def test_throughput_worker_on_a_tiny_model(tiny_llama_dir) -> None:
    spec = dict(model=str(tiny_llama_dir), load_format="auto", eager=True, dtype="float32",
                kv_cache_memory="8MiB", max_model_len=256, attention_backend="torch",
                batches=[1, 3], lens=[8, 4], copy_mib=8)
    proc = _run("--device", "cpu", "--throughput-worker", json.dumps(spec))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("THROUGHPUT_JSON ")]
    res = json.loads(line.removeprefix("THROUGHPUT_JSON "))
    assert [r["batch"] for r in res["rows"]] == [1, 3]
    assert res["graph_steps"] == {} and res["capture_s"] == 0.0  # CPU: never graphs
    assert res["copy_bw"] > 0
    for r in res["rows"]:
        assert r["step_ms"] > 0
        assert r["decode_tok_s"] == pytest.approx(r["batch"] / (r["step_ms"] / 1e3))
    # Per step: all weights but the input embedding table (gathered), plus each sequence's mean
    # context (8 prompt + 4/2 generated tokens) x K/V bytes per token of the tiny model
    # (2 x 2 layers x 2 kv heads x head_dim 16 x 4 bytes = 512).
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_llama_dir)
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv_dim = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    layer = h * (h + 2 * kv_dim) + h * h + 3 * h * inter + 2 * h  # qkv, o, gate/up/down, norms
    weights = 4 * (cfg.num_hidden_layers * layer + h + vocab * h)  # + final norm, LM head
    per_token = 2 * cfg.num_hidden_layers * kv_dim * 4
    assert per_token == 512
    for r in res["rows"]:
        assert r["bytes_per_step"] == weights + r["batch"] * (8 + 4 / 2) * per_token
