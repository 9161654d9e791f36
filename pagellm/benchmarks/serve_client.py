"""The client behind ``pagellm bench serve``: the dataset, Poisson arrivals, one streaming request,
and one run at one rate (``benchmark``). Statistics are in serve_stats.py, the command in serve.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from pagellm.benchmarks.serve_stats import RequestResult, judge_sustained, summarize


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int
    num_prompt_tokens: int | None = None


def load_dataset(path: str, num_prompts: int, input_len: int, output_len: int,
                 vocab_size: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """``random`` (token ids drawn uniformly, lengths within +-range_ratio) or a JSONL file of
    {"prompt_token_ids": [...] | "prompt": "...", "max_tokens": N} (cycled to num_prompts)."""
    rng = random.Random(seed)
    if path == "random":
        def length(mean: int) -> int:
            lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
            return rng.randint(lo, hi)

        out = []
        for _ in range(num_prompts):
            ids = [rng.randrange(vocab_size) for _ in range(length(input_len))]
            out.append(BenchRequest(ids, length(output_len), len(ids)))
        return out
    items = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row.get("prompt_token_ids", row.get("prompt"))
            if prompt is None:
                raise ValueError(f"{path}:{line_no}: needs 'prompt_token_ids' or 'prompt'.")
            num = len(prompt) if isinstance(prompt, list) else None
            items.append(BenchRequest(prompt, int(row.get("max_tokens", output_len)), num))
    if not items:
        raise ValueError(f"--dataset {path}: no requests in the file.")
    return [items[i % len(items)] for i in range(num_prompts)]


def arrival_intervals(n: int, rate: float, seed: int) -> list[float]:
    """Gaps before each request: exponential with mean 1/rate (a Poisson process); 0 for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return [0.0] + list(rng.exponential(1.0 / rate, size=n - 1)) if n else []


def _payload(req: BenchRequest, model: str, chat: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        if not isinstance(req.prompt, str):
            raise ValueError("The chat endpoint needs text prompts, not prompt_token_ids.")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                       headers: dict[str, str]) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    num_chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))
                    return res
                if obj.get("usage"):
                    res.num_output_tokens = obj["usage"]["completion_tokens"]
                    res.num_prompt_tokens = obj["usage"]["prompt_tokens"]
                for choice in obj.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if num_chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                    num_chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - start
    res.num_output_tokens = res.num_output_tokens or num_chunks
    res.success = num_chunks > 0 or res.num_output_tokens > 0
    if not res.success:
        res.error = "no output"
    return res


async def _arrivals(requests: list[BenchRequest], rate: float,
                    seed: int) -> AsyncIterator[BenchRequest]:
    for req, gap in zip(requests, arrival_intervals(len(requests), rate, seed), strict=True):
        if gap > 0:
            await asyncio.sleep(gap)
        yield req


async def benchmark(base_url: str, requests: list[BenchRequest], *, model: str | None = None,
                    endpoint: str = "/v1/completions", request_rate: float = math.inf,
                    max_concurrency: int | None = None, api_key: str | None = None,
                    ignore_eos: bool = False, seed: int = 0, timeout_s: float = 3600.0,
                    num_warmups: int = 0, slo_ttft_s: float = 2.0,
                    slo_tpot_s: float = 0.2) -> dict[str, Any]:
    """One run at one rate. ``num_warmups`` requests (the first prompts, at most 16 tokens out)
    go first, one at a time and untimed, so one-off costs (compilation, caches) stay out."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        if model is None:
            r = await client.get(f"{base_url}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        chat = "chat" in endpoint
        url = f"{base_url}{endpoint}"
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        for req in requests[:num_warmups]:
            warm = BenchRequest(req.prompt, min(req.max_tokens, 16), req.num_prompt_tokens)
            res = await send_request(client, url, _payload(warm, model, chat, ignore_eos),
                                     headers)
            if not res.success:
                raise RuntimeError(f"warm-up request failed: {res.error}")

        async def one(req: BenchRequest) -> RequestResult:
            arrival = time.perf_counter() - start
            body = _payload(req, model, chat, ignore_eos)
            if sem is None:
                res = await send_request(client, url, body, headers)
            else:
                async with sem:
                    res = await send_request(client, url, body, headers)
            if res.num_prompt_tokens is None:
                res.num_prompt_tokens = req.num_prompt_tokens
            res.arrival = arrival
            return res

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in _arrivals(requests, request_rate,
                                                                          seed)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    verdict = judge_sustained(results, request_rate, summary["request_throughput"],
                              slo_ttft_s, slo_tpot_s)
    summary.update(model=model, base_url=base_url, endpoint=endpoint,
                   request_rate=request_rate if math.isfinite(request_rate) else "inf",
                   max_concurrency=max_concurrency, num_prompts=len(requests),
                   sustained=verdict.pop("sustained"), sustained_detail=verdict)
    return summary


__all__ = ["BenchRequest", "arrival_intervals", "benchmark", "load_dataset", "send_request"]
