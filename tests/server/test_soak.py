"""A short soak (scripts/soak.py's run_soak): 200 mixed requests with disconnects, stop strings,
n > 1, salted prefix caching, priorities and a KV cache small enough to preempt. Afterwards
nothing runs or waits, no KV block is held, and the server is healthy."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_utils import ServerProcess, load_soak, metric, scrape, wait_until

# 40 blocks of 16 tokens for up to 16 running requests of ~20-60 tokens: preemptions happen.
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "40",
        "--enable-prefix-caching", "--max-num-seqs", "16", "--scheduling-policy", "priority"]
NUM_REQUESTS = 200


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    srv = ServerProcess([str(tiny_llama_dir), *ARGS], log)
    yield srv
    srv.stop()


def test_soak(server):
    soak = load_soak()
    report = asyncio.run(soak.run_soak(server.base_url, NUM_REQUESTS, concurrency=16, seed=0))
    assert report.failures == [], report.failures[:10]
    assert report.completed + report.disconnected == NUM_REQUESTS and report.rejected == 0
    assert report.disconnected >= 20 and report.streamed >= 40
    # The same greedy prompt was served several times (different batches, salts, preemptions).
    assert sum(1 for runs in report.greedy_runs.values() if runs >= 2) >= 10
    print(report.summary())
    base = server.base_url
    assert wait_until(lambda: metric(scrape(base), "pagellm:num_requests_running") == 0
                      and metric(scrape(base), "pagellm:num_requests_waiting") == 0, 60)
    m = scrape(base)
    assert metric(m, "pagellm:kv_cache_usage_perc") == 0  # no leaked block
    assert metric(m, "pagellm:num_preemptions_total") > 0  # the KV pressure was real
    assert metric(m, "pagellm:prefix_cache_hits_total") > 0
    assert httpx.get(f"{base}/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log and "Unhandled error" not in log
