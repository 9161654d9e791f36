"""``pagellm bench serve``: an async load generator for any OpenAI-compatible server.

Requests arrive as a Poisson process (``--request-rate``, inf = all at once), at most
``--max-concurrency`` in flight, all streaming. Reported per request: TTFT (time to the first
text), TPOT ((e2e - TTFT) / (output tokens - 1)), inter-token latencies (gaps between streamed
chunks) and end-to-end latency; over the run: request and token throughput. Output token counts
come from the server's usage (``stream_options.include_usage``), else from the chunk count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int
    num_prompt_tokens: int | None = None


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0


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
                    ignore_eos: bool = False, seed: int = 0, timeout_s: float = 3600.0
                    ) -> dict[str, Any]:
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

        async def one(req: BenchRequest) -> RequestResult:
            body = _payload(req, model, chat, ignore_eos)
            if sem is None:
                res = await send_request(client, url, body, headers)
            else:
                async with sem:
                    res = await send_request(client, url, body, headers)
            if res.num_prompt_tokens is None:
                res.num_prompt_tokens = req.num_prompt_tokens
            return res

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in _arrivals(requests, request_rate,
                                                                          seed)]
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary.update(model=model, base_url=base_url, endpoint=endpoint,
                   request_rate=request_rate if math.isfinite(request_rate) else "inf",
                   max_concurrency=max_concurrency, num_prompts=len(requests))
    return summary


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.num_prompt_tokens or 0 for r in ok)
    total_out = sum(r.num_output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    duration = max(duration, 1e-9)
    return {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]), "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]),
        "e2e_latency_ms": _stats_ms([r.e2e for r in ok]),
    }


def format_summary(s: dict[str, Any]) -> str:
    w = 40
    lines = ["{:=^60}".format(" Serving Benchmark Result "),
             f"{'Successful requests:':<{w}}{s['completed']}",
             f"{'Failed requests:':<{w}}{s['failed']}",
             f"{'Benchmark duration (s):':<{w}}{s['duration_s']:.2f}",
             f"{'Total input tokens:':<{w}}{s['total_input_tokens']}",
             f"{'Total generated tokens:':<{w}}{s['total_output_tokens']}",
             f"{'Request throughput (req/s):':<{w}}{s['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<{w}}{s['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<{w}}{s['total_token_throughput']:.2f}"]
    for key, title in (("ttft_ms", "Time to First Token"),
                       ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_latency_ms", "End-to-end Latency")):
        name = key.split("_")[0].upper()
        lines.append("{:-^60}".format(f" {title} "))
        for stat in ("mean", "median", "p90", "p99"):
            label = {"mean": "Mean", "median": "Median", "p90": "P90", "p99": "P99"}[stat]
            lines.append(f"{f'{label} {name} (ms):':<{w}}{s[key][stat]:.2f}")
    for err in s["errors"]:
        lines.append(f"error: {err}")
    lines.append("=" * 60)
    return "\n".join(lines)


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server (streaming)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None, help="default: env PAGELLM_API_KEY or "
                   "OPENAI_API_KEY")
    p.add_argument("--dataset", default="random",
                   help="'random', or a JSONL file of {prompt_token_ids|prompt, max_tokens}")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-vocab-size", type=int, default=10000,
                   help="random token ids are drawn below this")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos so every request generates max_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    p.add_argument("--output-json", default=None, help="also write the results here")
    p.set_defaults(func=run_bench_serve)
    return p


def run_bench_serve(ns: argparse.Namespace) -> int:
    """The ``pagellm bench serve`` command: prints the report (and writes --output-json)."""
    bench_serve(ns)
    return 0


def bench_serve(ns: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the parsed flags; returns the summary."""
    if ns.num_prompts < 1:
        raise SystemExit("error: --num-prompts must be >= 1")
    if ns.request_rate <= 0:
        raise SystemExit("error: --request-rate must be > 0 (inf for all at once)")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise SystemExit("error: --max-concurrency must be >= 1")
    requests = load_dataset(ns.dataset, ns.num_prompts, ns.random_input_len,
                            ns.random_output_len, ns.random_vocab_size, ns.random_range_ratio,
                            ns.seed)
    api_key = ns.api_key or os.environ.get("PAGELLM_API_KEY") or os.environ.get("OPENAI_API_KEY")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    summary = asyncio.run(benchmark(
        ns.base_url, requests, model=ns.model, endpoint=ns.endpoint,
        request_rate=ns.request_rate, max_concurrency=ns.max_concurrency, api_key=api_key,
        ignore_eos=ns.ignore_eos, seed=ns.seed, timeout_s=ns.timeout))
    print(format_summary(summary))
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    return summary


__all__ = ["BenchRequest", "RequestResult", "add_bench_serve_parser", "bench_serve", "benchmark",
           "load_dataset", "run_bench_serve", "summarize"]
