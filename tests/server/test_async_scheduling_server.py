"""`pagellm serve --async-scheduling` on the tiny model: concurrent streamed completions (greedy,
seeded, stop tokens, n > 1) give exactly the offline synchronous engine's text, and mixed
traffic with client disconnects (scripts/soak.py, short) leaves no request and no KV block."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_utils import PAGELLM_SERVE, ServerProcess, load_soak, metric, scrape, wait_until

from pagellm import LLM, SamplingParams

# Few blocks (preemptions) and a small token budget (chunked prompts, mixed steps); the soak
# sends priorities.
ENGINE = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=24,
              max_num_batched_tokens=48, max_num_seqs=12, enable_prefix_caching=True,
              scheduling_policy="priority")
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "24",
        "--max-num-batched-tokens", "48", "--max-num-seqs", "12", "--enable-prefix-caching",
        "--scheduling-policy", "priority", "--served-model-name", "tiny", "--async-scheduling"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    srv = ServerProcess([str(tiny_llama_dir), *ARGS],
                        tmp_path_factory.mktemp("async-scheduling") / "server.log",
                        command=PAGELLM_SERVE)
    yield srv
    srv.stop()


def cases() -> list[tuple[str, dict]]:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "the", "quick", "fox", "jumps", "over"]
    out = []
    for i in range(12):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
        body: dict = {"max_tokens": rng.choice([1, 5, 17, 40]), "ignore_eos": i % 3 != 0}
        if i % 2:
            body.update(temperature=1.0, seed=i)
        else:
            body.update(temperature=0.0)
        if i % 4 == 1:
            body["stop_token_ids"] = [rng.randrange(3, 400) for _ in range(30)]
        if i % 5 == 3:
            body["n"] = 2
        out.append((prompt, body))
    return out


def to_params(body: dict) -> SamplingParams:
    return SamplingParams(temperature=body["temperature"], seed=body.get("seed"),
                          max_tokens=body["max_tokens"], ignore_eos=body["ignore_eos"],
                          stop_token_ids=body.get("stop_token_ids"), n=body.get("n", 1))


def stream(base_url: str, prompt: str, body: dict) -> list[tuple[str, str]]:
    """(text, finish_reason) per choice, from a streamed completion."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    extra = {k: body[k] for k in ("ignore_eos", "stop_token_ids") if k in body}
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.completions.create(
            model="tiny", prompt=prompt, stream=True, max_tokens=body["max_tokens"],
            temperature=body["temperature"], seed=body.get("seed"), n=body.get("n", 1),
            extra_body=extra):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return [(texts[i], reasons[i]) for i in sorted(texts)]


def test_streamed_outputs_match_offline_synchronous_engine(server, tiny_llama_dir) -> None:
    work = cases()
    with ThreadPoolExecutor(len(work)) as pool:  # concurrent: the server batches them
        got = list(pool.map(lambda c: stream(server.base_url, *c), work))
    llm = LLM(model=str(tiny_llama_dir), seed=0, **ENGINE)
    outs = llm.generate([p for p, _ in work], [to_params(b) for _, b in work], use_tqdm=False)
    want = [[(c.text, c.finish_reason) for c in o.outputs] for o in outs]
    assert got == want
    assert {r for choices in want for _, r in choices} == {"stop", "length"}


def test_disconnects_and_mixed_traffic_leak_no_block(server) -> None:
    report = asyncio.run(load_soak().run_soak(server.base_url, 60, concurrency=12, seed=1))
    assert report.failures == [], report.failures[:10]
    assert report.completed + report.disconnected == 60 and report.disconnected > 0
    base = server.base_url
    assert wait_until(lambda: metric(scrape(base), "pagellm:num_requests_running") == 0
                      and metric(scrape(base), "pagellm:num_requests_waiting") == 0, 60)
    m = scrape(base)
    assert metric(m, "pagellm:kv_cache_usage_perc") == 0  # no leaked block
    assert metric(m, "pagellm:num_preemptions_total") > 0
    assert httpx.get(f"{base}/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log and "Unhandled error" not in log
