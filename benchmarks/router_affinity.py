"""Why a cache-aware router matters: a multi-tenant chat workload on 2 replicas with prefix
caching, routed by vllm-router's cache_aware policy, then by round_robin.

usage: python benchmarks/router_affinity.py [--policies cache_aware,round_robin] [--tenants 8]
       [--users-per-tenant 8] [--system-words 220] [--concurrency 4] [--output-len 8]
       [--kv-blocks 112] [--out JSON] [-- extra pagellm serve flags]

Each tenant has one system prompt (~200-400 tokens of its own text); each user sends one short
question under their tenant's system prompt (chat, streamed). Requests are shuffled (seeded) and
sent ``--concurrency`` at a time. Two ``pagellm serve`` replicas of the default model (SmolLM2-
135M) start once, with ``--enable-prefix-caching`` and a KV cache of ``--kv-blocks`` blocks each:
too small for every tenant's prompt at once, big enough for half of them. Then, per policy:
reset both replicas' prefix caches, put the router in front
(``python -m pagellm.entrypoints.replicas --backend ... --policy P``), run the workload, and
read each replica's /metrics before and after: prefix-cache hit rate (prompt tokens served from
the cache / prompt tokens looked up), server-side mean time to first token, requests per
replica. Client-side mean TTFT (request sent to first streamed token, through the router) too.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagellm.entrypoints.ports import free_port

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when if "
         "so no will can more about said what up its into than them only other new some could "
         "time these two may then do first any my now such like our over man me even most made "
         "after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still "
         "own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used "
         "take three").split()
METRICS = ("prefix_cache_queries_total", "prefix_cache_hits_total",
           "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
           "request_success_total")


@dataclass
class ChatRequest:
    tenant: int
    system: str
    question: str


def build_workload(tenants: int, users_per_tenant: int, system_words: int,
                   seed: int) -> list[ChatRequest]:
    rng = random.Random(seed)
    systems = [f"You are the assistant of company {t}. " +
               " ".join(rng.choice(WORDS) for _ in range(system_words)) for t in range(tenants)]
    out = [ChatRequest(t, systems[t], "Question: " + " ".join(
        rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + "?")
           for t in range(tenants) for _ in range(users_per_tenant)]
    rng.shuffle(out)
    return out


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} not up after {timeout_s} s")
        time.sleep(1)


def scrape(worker: str) -> dict[str, float]:
    text = httpx.get(f"{worker}/metrics", timeout=10).text
    out = dict.fromkeys(METRICS, 0.0)
    for name in METRICS:
        for value in re.findall(rf"^pagellm:{name}(?:\{{.*\}})? (\S+)$", text, re.M):
            out[name] += float(value)
    return out


def send(router: str, model: str, req: ChatRequest, output_len: int) -> float:
    """Client-side time to the first streamed token, in seconds."""
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "system", "content": req.system},
                                         {"role": "user", "content": req.question}]}
    start = time.perf_counter()
    ttft = None
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if ttft is None and line.startswith("data: {"):
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                if choice.get("delta", {}).get("content") or choice.get("finish_reason"):
                    ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft


def run_policy(policy: str, workers: list[str], model: str, workload: list[ChatRequest],
               ns: argparse.Namespace) -> dict:
    for worker in workers:
        assert httpx.post(f"{worker}/reset_prefix_cache", timeout=60).json()["success"]
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "pagellm.entrypoints.replicas", "--policy", policy, "--port",
         str(port), *(a for w in workers for a in ("--backend", w))], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", router, 120)
        before = [scrape(w) for w in workers]
        start = time.perf_counter()
        with ThreadPoolExecutor(ns.concurrency) as pool:
            ttfts = list(pool.map(lambda r: send(url, model, r, ns.output_len), workload))
        elapsed = time.perf_counter() - start
        after = [scrape(w) for w in workers]
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(60)
    delta = [{k: a[k] - b[k] for k in METRICS} for a, b in zip(after, before, strict=True)]
    total = {k: sum(d[k] for d in delta) for k in METRICS}
    return {
        "policy": policy,
        "prefix_hit_rate": total["prefix_cache_hits_total"] / total["prefix_cache_queries_total"],
        "prompt_tokens_computed": total["prefix_cache_queries_total"]
        - total["prefix_cache_hits_total"],
        "server_mean_ttft_s": total["time_to_first_token_seconds_sum"]
        / total["time_to_first_token_seconds_count"],
        "client_mean_ttft_s": sum(ttfts) / len(ttfts),
        "requests_per_replica": [d["request_success_total"] for d in delta],
        "hit_rate_per_replica": [d["prefix_cache_hits_total"] / d["prefix_cache_queries_total"]
                                 if d["prefix_cache_queries_total"] else None for d in delta],
        "elapsed_s": elapsed,
    }


def main() -> None:
    argv = sys.argv[1:]
    serve_extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--users-per-tenant", type=int, default=8)
    p.add_argument("--system-words", type=int, default=220, help="words per system prompt")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=112, help="KV blocks per replica (16 tokens)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    ns = p.parse_args(argv)
    workload = build_workload(ns.tenants, ns.users_per_tenant, ns.system_words, ns.seed)
    # --enable-admin-routes: the replicas have no keys, and /reset_prefix_cache is an admin route.
    serve = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", "--enable-prefix-caching",
             "--num-gpu-blocks-override", str(ns.kv_blocks), "--max-model-len", "1024",
             "--enable-admin-routes", *serve_extra]
    ports = [free_port() for _ in range(2)]
    replicas = [subprocess.Popen([*serve, "--port", str(port)], cwd=REPO) for port in ports]
    workers = [f"http://127.0.0.1:{port}" for port in ports]
    results = []
    try:
        for worker, proc in zip(workers, replicas, strict=True):
            wait_http(f"{worker}/health", proc)
        model = httpx.get(f"{workers[0]}/v1/models", timeout=10).json()["data"][0]["id"]
        for policy in ns.policies.split(","):
            results.append(run_policy(policy, workers, model, workload, ns))
            print(json.dumps(results[-1]), flush=True)
    finally:
        for proc in replicas:
            proc.send_signal(signal.SIGTERM)
        for proc in replicas:
            proc.wait(60)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"\n{len(workload)} requests, {ns.tenants} tenants, concurrency {ns.concurrency}, "
          f"{ns.kv_blocks} KV blocks per replica, load average {' '.join(load)}")
    print("| policy | prefix hit rate | prompt tokens computed | mean TTFT (server) | "
          "mean TTFT (client) | requests per replica | wall time |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['prefix_hit_rate']:.1%} | {r['prompt_tokens_computed']:.0f}"
              f" | {r['server_mean_ttft_s'] * 1000:.0f} ms | {r['client_mean_ttft_s'] * 1000:.0f}"
              f" ms | {' / '.join(f'{n:.0f}' for n in r['requests_per_replica'])} | "
              f"{r['elapsed_s']:.1f} s |")
    if ns.out:
        Path(ns.out).write_text(json.dumps({"args": vars(ns), "load_average": load,
                                            "results": results}, indent=2))


if __name__ == "__main__":
    main()
