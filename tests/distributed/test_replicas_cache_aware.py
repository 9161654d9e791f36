"""vllm-router's cache_aware policy in front of two real `pagellm serve` replicas
(scripts/replicas.py): the router renders each text request into token ids on the replicas with
vLLM's render endpoints (/v1/completions/render, /v1/chat/completions/render), and its own
metrics say the render succeeded (``vllm_router_kv_routing_inputs_total{result="render"}``);
were the endpoints missing (404) it would count ``result="tokenize"`` (its /tokenize fallback)
instead. The client's key reaches the render calls: the replicas enforce it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagellm.entrypoints.ports import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 600.0
SERVE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
               "--served-model-name", "tiny"]
KEY = "sk-cache-aware-test-key"
ROUTING_INPUTS = re.compile(
    r'^vllm_router_kv_routing_inputs_total\{transport="http",result="(\w+)"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def launcher(tiny_model_dir, tmp_path_factory):
    port, metrics_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("cache-aware") / "replicas.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "replicas.py"), "-dp", "2",
             "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
             "--router-metrics-port", str(metrics_port), "--health-interval", "1",
             "--api-key", KEY, "--", str(tiny_model_dir("llama")), *SERVE_FLAGS],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Serving on" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def routing_inputs(metrics_url: str) -> dict[str, float]:
    """How the router got each request's token ids, by result ("render", "tokenize", ...)."""
    text = httpx.get(f"{metrics_url}/metrics", timeout=10).text
    return {result: float(v) for result, v in ROUTING_INPUTS.findall(text)}


def test_cache_aware_routes_with_the_replicas_render_endpoints(launcher) -> None:
    url, metrics_url = launcher
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    before = routing_inputs(metrics_url)
    done = client.completions.create(model="tiny", prompt="a shared prefix and then some",
                                     max_tokens=3, temperature=0.0)
    assert done.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=3,
        temperature=0.0)
    assert chat.choices[0].message.content is not None
    after = routing_inputs(metrics_url)
    gained = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    # One render per replica per request (the router asks every worker); no fallback.
    assert gained.get("render", 0.0) >= 2, (before, after)
    assert gained.get("tokenize", 0.0) == 0, (before, after)
    # A client without the key is refused by the replicas, render calls included.
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x",
                                                   "max_tokens": 1}, timeout=60)
    assert r.status_code == 401, r.text
