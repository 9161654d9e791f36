"""Soak a running pagellm server with mixed traffic and check that nothing is lost or leaked.

Traffic: /v1/completions and /v1/chat/completions, streaming and not, n in 1..3, stop strings,
shared prompt prefixes with and without cache_salt, priorities, and random client disconnects.
Checks per request: HTTP 200, usage consistent with the choices (prompt tokens = /tokenize of the
prompt, completion tokens = n * max_tokens where every choice ran to its length), and every
greedy run of the same prompt gives the same text whatever the batch, salt or preemption. At the
end: running = waiting = 0, KV usage 0 (no leaked block), the server healthy.

Long form (not run in CI; the server is started here on the default model unless --url):

    .venv/bin/python scripts/soak.py --requests 5000 --concurrency 32 \
        --server-args "--dtype float32 --enable-prefix-caching --num-gpu-blocks-override 64"

tests/server/test_soak.py runs ``run_soak`` in a short form. Memory (RSS of the server and its
engine process) is sampled every second with --url unset and reported as first/peak/last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PREFIXES = ["The quick brown fox jumps over the lazy dog. " * 3,
            "Once upon a time, in a land far away, there lived ",
            "def fibonacci(n):\n    if n < 2:\n        return n\n"]
SALTS = [None, None, "tenant-a", "tenant-b"]


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    rejected: int = 0  # 503 from --max-waiting-requests
    streamed: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)
    greedy_texts: dict[str, set[str]] = field(default_factory=dict)
    greedy_runs: Counter = field(default_factory=Counter)
    elapsed_s: float = 0.0

    def summary(self) -> dict:
        skip = ("failures", "greedy_texts", "greedy_runs")
        return {k: v for k, v in self.__dict__.items() if k not in skip} \
            | {"failures": len(self.failures), "greedy_groups": len(self.greedy_texts),
               "greedy_repeats": sum(n - 1 for n in self.greedy_runs.values())}


def make_request(rng: random.Random, i: int) -> dict:
    """One random request spec (endpoint, body, disconnect plan)."""
    prompt = rng.choice(PREFIXES) + rng.choice(["", "and then", f"story {i % 7}"])
    greedy = rng.random() < 0.5
    # Greedy runs repeat few shapes, so the same output is checked across batches and salts.
    max_tokens = rng.choice([8, 16]) if greedy else rng.randint(1, 24)
    body: dict = {"max_tokens": max_tokens, "n": 1 if greedy else rng.choice([1, 2, 3]),
                  "temperature": 0.0 if greedy else 1.0, "seed": None if greedy else i,
                  "ignore_eos": True, "stream": rng.random() < 0.5,
                  "priority": rng.choice([-1, 0, 0, 1])}
    if not greedy and rng.random() < 0.4:
        body["stop"] = [rng.choice("aeiou"), "the"]
    salt = rng.choice(SALTS)
    if salt:
        body["cache_salt"] = salt
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    chat = rng.random() < 0.3
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    disconnect_after = rng.choice([None] * 8 + [0, 1, 3])  # about a quarter disconnect
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "body": body,
            "disconnect_after": disconnect_after, "greedy": greedy, "prompt": prompt}


async def one(client: httpx.AsyncClient, spec: dict, report: SoakReport,
              prompt_len: dict[str, int]) -> None:
    body, path = spec["body"], spec["path"]
    chat = "messages" in body
    if body["stream"]:
        choices: dict[int, dict] = {}
        usage = None
        chunks = 0
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code == 503:
                report.rejected += 1
                return
            if resp.status_code != 200:
                report.failures.append(f"{path} {resp.status_code}: {await resp.aread()}")
                return
            async for line in resp.aiter_lines():
                if spec["disconnect_after"] is not None and chunks >= spec["disconnect_after"]:
                    report.disconnected += 1
                    return  # leaving the block closes the connection
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    report.failures.append(f"stream error: {data}")
                    return
                chunks += 1
                usage = data.get("usage") or usage
                for c in data["choices"]:
                    entry = choices.setdefault(c["index"], {"text": "", "finish_reason": None})
                    entry["text"] += (c["delta"].get("content") or "") if chat else c["text"]
                    entry["finish_reason"] = c["finish_reason"] or entry["finish_reason"]
        report.streamed += 1
        result = {"choices": list(choices.values()), "usage": usage}
    else:
        task = asyncio.ensure_future(client.post(path, json=body))
        if spec["disconnect_after"] is not None:
            await asyncio.sleep(0.05 * spec["disconnect_after"])
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                report.disconnected += 1
                return
        resp = await task
        if resp.status_code == 503:
            report.rejected += 1
            return
        if resp.status_code != 200:
            report.failures.append(f"{path} {resp.status_code}: {resp.text}")
            return
        data = resp.json()
        result = {"choices": [{"text": c["message"]["content"] if chat else c["text"],
                               "finish_reason": c["finish_reason"]} for c in data["choices"]],
                  "usage": data["usage"]}
    check(spec, result, report, prompt_len)


def check(spec: dict, result: dict, report: SoakReport, prompt_len: dict[str, int]) -> None:
    body = spec["body"]
    choices, usage = result["choices"], result["usage"]
    report.completed += 1
    if len(choices) != body["n"] or usage is None:
        report.failures.append(f"{len(choices)} choices / usage {usage} for n={body['n']}")
        return
    report.tokens += usage["completion_tokens"]
    if "prompt" in body and usage["prompt_tokens"] != prompt_len[spec["prompt"]]:
        report.failures.append(f"prompt_tokens {usage['prompt_tokens']} != "
                               f"{prompt_len[spec['prompt']]}")
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        report.failures.append(f"inconsistent usage {usage}")
    if all(c["finish_reason"] == "length" for c in choices) and \
            usage["completion_tokens"] != body["n"] * body["max_tokens"]:
        report.failures.append(f"completion_tokens {usage} != n * max_tokens for {body}")
    for c in choices:
        if c["finish_reason"] not in ("length", "stop"):
            report.failures.append(f"finish_reason {c['finish_reason']}")
        if c["finish_reason"] == "stop" and any(s in c["text"] for s in body.get("stop", [])):
            report.failures.append(f"stop string left in the text: {c['text']!r}")
    if spec["greedy"]:
        key = f"{spec['path']}|{spec['prompt']}|{body['max_tokens']}"
        report.greedy_texts.setdefault(key, set()).add(choices[0]["text"])
        report.greedy_runs[key] += 1


async def run_soak(base_url: str, num_requests: int, concurrency: int = 16,
                   seed: int = 0) -> SoakReport:
    rng = random.Random(seed)
    specs = [make_request(rng, i) for i in range(num_requests)]
    report = SoakReport(requests=num_requests)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        prompt_len = {}
        for spec in specs:
            p = spec["prompt"]
            if p not in prompt_len:
                r = await client.post("/tokenize", json={"prompt": p})
                prompt_len[p] = r.json()["count"]
        sem = asyncio.Semaphore(concurrency)
        start = time.monotonic()

        async def guarded(spec: dict) -> None:
            async with sem:
                try:
                    await one(client, spec, report, prompt_len)
                except Exception as e:  # a transport error is a failure, not a crash
                    report.failures.append(f"{spec['path']}: {e!r}")

        await asyncio.gather(*(guarded(s) for s in specs))
        report.elapsed_s = time.monotonic() - start
    for key, texts in report.greedy_texts.items():
        if len(texts) != 1:
            report.failures.append(f"greedy outputs differ for {key}: {texts}")
    return report


def rss_kib(pid: int) -> tuple[int, int]:
    """RSS of a process and of its children (the engine core), in KiB."""
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    sizes = []
    for p in pids:
        size = 0
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    size = int(line.split()[1])
        except OSError:
            pass
        sizes.append(size)
    return sizes[0], sum(sizes[1:])


def rss_figures(samples: list[tuple[int, int]], idle: list[tuple[int, int]]) -> dict:
    """MiB of the server and engine processes: first sample, peak, and at idle after each
    round (flat memory: the last idle figure close to the first)."""
    out = {}
    for i, name in enumerate(("server", "engine")):
        xs = [s[i] for s in samples]
        out[f"rss_mib_{name}_first_peak"] = [round(x / 1024) for x in xs[:1] + [max(xs or [0])]]
        out[f"rss_mib_{name}_idle_per_round"] = [round(s[i] / 1024) for s in idle]
    return out


def write_tiny_model(path: Path) -> Path:
    """The tests' tiny random Llama (2 layers, hidden 64, ~400-token BPE), written once."""
    if not (path / "config.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from conftest import write_tiny_model as write

        write(path, "llama")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="soak this server instead of starting one")
    parser.add_argument("--model", default=None)
    parser.add_argument("--tiny-model", default=None, metavar="DIR",
                        help="serve the tests' tiny random Llama, written to DIR if not there")
    parser.add_argument("--server-args", default="--dtype float32 --enable-prefix-caching "
                        "--num-gpu-blocks-override 64 --scheduling-policy priority")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5,
                        help="split the requests in rounds; RSS is reported after each")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
    from server_utils import ServerProcess, metric, scrape, wait_until

    server = None
    if ns.url is None:
        model = str(write_tiny_model(Path(ns.tiny_model))) if ns.tiny_model else ns.model
        args = ([model] if model else []) + shlex.split(ns.server_args)
        server = ServerProcess(args, Path("soak_server.log"))
    base = ns.url or server.base_url
    samples: list[tuple[int, int]] = []  # (server, engine) RSS in KiB, every second
    idle_rss: list[tuple[int, int]] = []  # after each round, at idle
    stop = threading.Event()

    def sample() -> None:
        while server is not None and not stop.is_set():
            samples.append(rss_kib(server.proc.pid))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        per_round = max(1, ns.requests // ns.rounds)
        total = SoakReport()
        for r in range(ns.rounds):
            rep = asyncio.run(run_soak(base, per_round, ns.concurrency, ns.seed + r))
            for k in ("requests", "completed", "disconnected", "rejected", "streamed",
                      "tokens"):
                setattr(total, k, getattr(total, k) + getattr(rep, k))
            total.failures += rep.failures
            total.greedy_runs += rep.greedy_runs
            for key, texts in rep.greedy_texts.items():
                total.greedy_texts.setdefault(key, set()).update(texts)
            total.elapsed_s += rep.elapsed_s
            idle = wait_until(lambda: metric(scrape(base), "pagellm:num_requests_running")
                              + metric(scrape(base), "pagellm:num_requests_waiting") == 0, 60)
            m = scrape(base)
            if server is not None:
                idle_rss.append(rss_kib(server.proc.pid))
            print(f"round {r}: {rep.summary()} idle={idle} "
                  f"kv_usage={metric(m, 'pagellm:kv_cache_usage_perc')} "
                  f"idle_rss_mib(server, engine)="
                  f"{[round(x / 1024) for x in idle_rss[-1]] if idle_rss else 'n/a'}",
                  flush=True)
            if metric(m, "pagellm:kv_cache_usage_perc") != 0:
                total.failures.append(f"round {r}: KV blocks still in use at idle")
        total.failures += [f"greedy outputs differ across rounds for {k}: {t}"
                           for k, t in total.greedy_texts.items() if len(t) != 1]
        health = httpx.get(f"{base}/health").status_code
        m = scrape(base)
        print(json.dumps(total.summary() | {
            "health": health, "preemptions": metric(m, "pagellm:num_preemptions_total"),
            "finish_reasons": dict(Counter({k: v for k, v in m.items()
                                            if k.startswith("pagellm:request_success_total")})),
            "prefix_cache_hits": metric(m, "pagellm:prefix_cache_hits_total"),
            "prefix_cache_queries": metric(m, "pagellm:prefix_cache_queries_total"),
            **rss_figures(samples, idle_rss)}, indent=1))
        for f in total.failures[:20]:
            print("FAIL", f)
        sys.exit(1 if total.failures or health != 200 else 0)
    finally:
        stop.set()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
