"""Step-level comparison: pagellm and vLLM-CPU loaded side by side, measurements alternating.

usage: python benchmarks/compare_vllm_steps.py [--shapes "0:256;16:256;16:640,384"]
       [--online 4,8] [--rounds 4] [--dtype bfloat16] [--vllm-python PATH] [--hf-dir DIR]
       [--out FILE.json] [--ab A_JSON B_JSON]

The machine's speed drifts a lot between minutes, so whole runs of two engines one after the
other compare poorly. Here each engine runs in-process in a worker process of its own (vLLM with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the settings of ../shared/PEERS.md, from its own venv),
both stay loaded, and every measurement alternates between them round after round (the order
flipped each round); each figure is the median over the rounds, with every pair's ratio.

- ``--shapes``: the time of one ``step()`` of a given shape, ``DECODES:PROMPT[,PROMPT...]``: that
  many requests decoding (256-token prompts, long outputs) and prompts of those lengths just
  added (``max_tokens`` 1), so the step is their prefill beside the decodes.
- ``--online``: an emulated online run per rate: 100 requests with Poisson arrivals fed to
  ``LLMEngine.step()`` as they come (prompts 128-384 tokens, outputs 64-192, greedy, ignore
  EOS; the arrival seed is the round number, the same for both engines), TTFT and TPOT
  percentiles as a client would see them, without the HTTP servers.
- ``--ab A_JSON B_JSON``: no vLLM; two pagellm engines whose ``LLM`` keyword arguments differ
  (e.g. ``'{}' '{"max_num_seqs": 64}'``), to compare scheduler settings A/B the same way. Online
  runs then also report e2e latency, output tokens/s and where the step time went by step shape
  (decoding requests x prefill tokens).
Check /proc/loadavg < 0.5 first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_vllm import VLLM_ENV, default_hf_dir  # noqa: E402


# ------------------------------------------------------------------------------------ worker
class Worker:
    """One engine, in this process; commands as JSON lines on stdin, answers on stdout."""

    def __init__(self, engine: str, dtype: str, hf_dir: str,
                 engine_kwargs: dict | None = None) -> None:
        self.engine = engine
        if engine == "vllm":
            from vllm import LLM, SamplingParams
            from vllm.sampling_params import RequestOutputKind

            self.llm = LLM(model=hf_dir, dtype=dtype, max_model_len=2048,
                           enable_prefix_caching=False, max_num_batched_tokens=2048,
                           max_num_seqs=256)
            self.delta = {"output_kind": RequestOutputKind.DELTA}
            self.add_kw: dict = {}
        else:
            sys.path.insert(0, str(REPO))
            from pagellm import LLM, SamplingParams
            from pagellm.engine.output_processor import OutputKind

            self.llm = LLM(dtype=dtype, max_model_len=2048, kv_cache_memory="4GiB",
                           **(engine_kwargs or {}))
            self.delta, self.add_kw = {}, {"kind": OutputKind.DELTA}
        self.params = SamplingParams
        self.e = self.llm.llm_engine
        self.last_shape: tuple[int, int] | None = None
        if engine != "vllm":
            self._watch_shapes()
        self.rng = random.Random(0)
        self.next_id = 0
        self.decoding: list[str] = []
        self.num_decoding = -1
        for n in (256, 1500, 300):  # warm-up
            self.add(self.prompt(n), 1)
            self.drain()

    def _watch_shapes(self) -> None:
        """Remember each step's shape (decoding requests, prefill tokens) for the profile."""
        sched = self.e.engine_core.scheduler
        schedule = sched.schedule

        def watched() -> object:
            out = schedule()
            counts = out.num_scheduled_tokens.values()
            decodes = sum(1 for n in counts if n == 1)
            self.last_shape = (decodes, out.total_num_scheduled_tokens - decodes)
            return out

        sched.schedule = watched

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 40000) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int, stream: bool = False) -> str:
        self.next_id += 1
        rid = f"r{self.next_id}"
        sp = self.params(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                         **(self.delta if stream else {}))
        self.e.add_request(rid, {"prompt_token_ids": prompt}, sp,
                           **(self.add_kw if stream else {}))
        return rid

    def drain(self) -> None:
        while self.e.has_unfinished_requests():
            self.e.step()

    def set_decodes(self, n: int) -> None:
        if n == self.num_decoding:
            return
        if self.decoding:
            self.e.abort_request(self.decoding)
        self.drain()
        self.decoding = [self.add(self.prompt(256), 1900) for _ in range(n)]
        for _ in range(64):  # past their prefill
            self.e.step()
        self.num_decoding = n

    def shape(self, decodes: int, prompts: list[int], reps: int) -> dict:
        self.set_decodes(decodes)
        times = []
        for _ in range(reps):
            for n in prompts:
                self.add(self.prompt(n), 1)
            start = time.perf_counter()
            self.e.step()
            times.append(time.perf_counter() - start)
            if not decodes:
                self.drain()
        return {"times": times}

    def online(self, rate: float, num: int, seed: int) -> dict:
        import numpy as np

        self.set_decodes(0)
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1 / rate, num))
        lens_in, lens_out = rng.integers(128, 385, num), rng.integers(64, 193, num)
        prompts = [rng.integers(100, 40000, int(n)).tolist() for n in lens_in]
        ids: list[str] = []
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        tokens: dict[str, int] = {}
        # step time by shape: (decodes bucket, prefill bucket) -> [steps, seconds]
        profile: dict[str, list[float]] = {}
        start = time.perf_counter()
        while len(last) < num:
            now = time.perf_counter() - start
            while len(ids) < num and arrivals[len(ids)] <= now:
                i = len(ids)
                ids.append(self.add(prompts[i], int(lens_out[i]), stream=True))
            if not self.e.has_unfinished_requests():
                time.sleep(max(0.0, arrivals[len(ids)] - now))
                continue
            self.last_shape = None
            before = time.perf_counter()
            outs = self.e.step()
            t = time.perf_counter() - start
            if self.last_shape is not None:
                key = shape_bucket(*self.last_shape)
                cell = profile.setdefault(key, [0, 0.0])
                cell[0] += 1
                cell[1] += time.perf_counter() - before
            for o in outs:
                k = len(o.outputs[0].token_ids)
                if k and o.request_id not in first:
                    first[o.request_id] = t
                tokens[o.request_id] = tokens.get(o.request_id, 0) + k
                if o.finished:
                    last[o.request_id] = t
        ttft = [1000 * (first[r] - arrivals[i]) for i, r in enumerate(ids)]
        tpot = [1000 * (last[r] - first[r]) / max(1, tokens[r] - 1) for r in ids]
        e2e = [last[r] - arrivals[i] for i, r in enumerate(ids)]

        def q(xs: list[float], p: float) -> float:
            return float(np.percentile(xs, p))

        return {"ttft_p50": q(ttft, 50), "ttft_p99": q(ttft, 99), "tpot_p50": q(tpot, 50),
                "tpot_p99": q(tpot, 99), "e2e_p50_s": q(e2e, 50),
                "out_tok_s": sum(tokens.values()) / max(last.values()),
                "duration_s": max(last.values()), "profile": profile}

    def serve(self) -> None:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "shape":
                out = self.shape(cmd["decodes"], cmd["prompts"], cmd["reps"])
            else:
                out = self.online(cmd["rate"], cmd["num"], cmd["seed"])
            print(json.dumps(out), flush=True)


def shape_bucket(decodes: int, prefill: int) -> str:
    """A step's shape, coarsely: decoding requests and prefill tokens, each in powers of 2."""
    def bucket(n: int) -> str:
        return "0" if n == 0 else f"<={1 << (n - 1).bit_length()}"

    return f"{bucket(decodes)} dec + {bucket(prefill)} pre"


# ------------------------------------------------------------------------------------ driver
def start_worker(name: str, python: str, ns: argparse.Namespace,
                 engine_kwargs: str = "{}") -> subprocess.Popen:
    # vLLM's engine in the worker's own process, so that step() is the whole step.
    vllm_env = {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env = {**os.environ, **(vllm_env if name == "vllm" else {})}
    log = open(Path(ns.log_dir) / f"steps_worker_{name}.log", "w")  # noqa: SIM115
    engine = "vllm" if name == "vllm" else "pagellm"
    proc = subprocess.Popen([python, __file__, "--worker", engine, "--dtype", ns.dtype,
                             "--hf-dir", ns.hf_dir, "--engine-kwargs", engine_kwargs],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO)
    for line in proc.stdout:
        if line.startswith("{") and "ready" in line:
            return proc
    raise SystemExit(f"the {name} worker exited; see {log.name}")


def ask(proc: subprocess.Popen, cmd: dict) -> dict:
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def parse_shapes(text: str) -> list[tuple[int, list[int]]]:
    shapes = []
    for part in filter(None, text.split(";")):
        decodes, _, prompts = part.partition(":")
        shapes.append((int(decodes), [int(p) for p in prompts.split(",") if p]))
    return shapes


def print_profile(name: str, runs: list[dict]) -> None:
    """Where the step time went, by step shape, summed over the rounds."""
    total: dict[str, list[float]] = {}
    for run in runs:
        for key, (steps, secs) in run["profile"].items():
            cell = total.setdefault(key, [0, 0.0])
            cell[0] += steps
            cell[1] += secs
    all_secs = sum(c[1] for c in total.values()) or 1.0
    print(f"  {name}: step time by shape (steps, share of time, mean ms)")
    for key, (steps, secs) in sorted(total.items(), key=lambda kv: -kv[1][1])[:8]:
        print(f"    {key:24} {int(steps):6d} {100 * secs / all_secs:5.1f}% "
              f"{1000 * secs / steps:7.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="0:256;0:512;0:256,256,256,256;16:;64:;16:256;16:640")
    ap.add_argument("--online", default="", help="request rates for emulated online runs")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=100, help="per online run")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vllm-python", default="/tmp/venv-vllm/bin/python")
    ap.add_argument("--hf-dir", default=None, help="the model as an HF folder, for vLLM "
                    "(default: pagellm's GGUF conversion cache of the default model)")
    ap.add_argument("--out", default=None, help="write every measurement here (JSON)")
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--ab", nargs=2, default=None, metavar=("A_JSON", "B_JSON"),
                    help="compare two pagellm configurations (LLM keyword arguments as JSON) "
                    "instead of pagellm and vLLM")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine-kwargs", default="{}", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.worker:
        Worker(ns.worker, ns.dtype, ns.hf_dir, json.loads(ns.engine_kwargs)).serve()
        return 0
    if ns.hf_dir is None:
        ns.hf_dir = str(default_hf_dir())
    print(f"load average at start: {open('/proc/loadavg').read().split()[0]}", flush=True)
    if ns.ab:
        names = ("A", "B")
        procs = {n: start_worker(n, sys.executable, ns, kw) for n, kw in zip(names, ns.ab,
                                                                             strict=True)}
    else:
        names = ("pagellm", "vllm")
        procs = {"pagellm": start_worker("pagellm", sys.executable, ns),
                 "vllm": start_worker("vllm", ns.vllm_python, ns)}
    shapes = parse_shapes(ns.shapes) if ns.shapes else []
    rates = [float(r) for r in ns.online.split(",") if r]
    results: dict[str, dict[str, list]] = {}
    try:
        for rnd in range(ns.rounds):
            order = list(names) if rnd % 2 == 0 else list(reversed(names))
            jobs = [(f"step {d} decodes + {p}", {"op": "shape", "decodes": d, "prompts": p,
                                                  "reps": 2}) for d, p in shapes]
            jobs += [(f"online {r} req/s", {"op": "online", "rate": r, "seed": rnd,
                                           "num": ns.num_prompts}) for r in rates]
            for key, cmd in jobs:
                for name in order:
                    results.setdefault(key, {}).setdefault(name, []).append(ask(procs[name], cmd))
            print(f"round {rnd + 1}/{ns.rounds} done", flush=True)
    finally:
        for proc in procs.values():
            proc.kill()
    print(f"{names[0]} / {names[1]}: median over rounds (each pair's ratio)"
          + (f"; A = {ns.ab[0]}, B = {ns.ab[1]}" if ns.ab else ""))
    for key, by in results.items():
        a, b = by[names[0]], by[names[1]]
        if key.startswith("step"):
            ta = [statistics.median(x["times"]) * 1000 for x in a]
            tb = [statistics.median(x["times"]) * 1000 for x in b]
            pairs = " ".join(f"{x / y:.2f}" for x, y in zip(ta, tb, strict=True))
            print(f"{key:40} {statistics.median(ta):8.1f} ms / {statistics.median(tb):8.1f} ms"
                  f" = {statistics.median(ta) / statistics.median(tb):.2f}  ({pairs})")
        else:
            print(key)
            for stat in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50_s",
                         "out_tok_s", "duration_s"):
                if stat not in a[0] or stat not in b[0]:
                    continue
                ma, mb = (statistics.median(x[stat] for x in v) for v in (a, b))
                pairs = " ".join(f"{x[stat] / y[stat]:.2f}" for x, y in zip(a, b, strict=True))
                print(f"  {stat:10} {ma:8.1f} / {mb:8.1f} = {ma / mb:.2f}  ({pairs})")
            for name, runs in ((names[0], a), (names[1], b)):
                if runs[0].get("profile"):
                    print_profile(name, runs)
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dtype": ns.dtype,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
