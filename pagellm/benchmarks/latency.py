"""``pagellm bench latency``: the latency of one batch, shaped like ``vllm bench latency``.

Each iteration submits ``--batch-size`` random-token prompts of exactly ``--input-len`` tokens
(fresh prompts every iteration, so a prefix cache cannot help) and generates exactly
``--output-len`` tokens each (greedy, EOS ignored), then steps the engine until all are done.
From the engine's step stream it also splits the batch latency into:

- prefill: submission until every request of the batch has its first token (the batch's TTFT);
- decode: the steps after that, each of which gives every running request one token, so the
  mean step time is the time per output token (TPOT) at that batch size.

The decode floor: a decode step must read every weight once, so it cannot take less than the
weight bytes read per step divided by the memory read bandwidth, both measured in this process
(the bandwidth by summing a tensor far larger than the caches after every timed iteration, on
CPU on 2 MiB pages as the weights are; the median sample: ``ReadBandwidth``).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagellm.benchmarks.workload import random_requests
from pagellm.engine_args import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)
_BANDWIDTH_SAMPLES_PER_ITER = 5


def add_latency_parser(sub: Any) -> None:
    p = sub.add_parser("latency", help="latency of one batch: prefill, decode per token, floor")
    EngineArgs.add_cli_args(p)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    p.add_argument("--batch-size", type=int, default=8, help="requests per batch")
    p.add_argument("--num-iters-warmup", type=int, default=3, help="untimed batches first")
    p.add_argument("--num-iters", type=int, default=10, help="timed batches")
    p.add_argument("--bandwidth-mib", type=int, default=512,
                   help="size of the tensor summed to measure memory read bandwidth (0: skip)")
    p.add_argument("--output-json", default=None, help="also write the result as JSON here")
    p.set_defaults(func=run_latency)


@dataclass(slots=True)
class BatchTiming:
    """One batch: times are seconds from submission."""

    latency_s: float
    first_output_s: float  # the first token of any request
    prefill_s: float  # every request has its first token
    decode_step_s: list[float] = field(default_factory=list)
    num_steps: int = 0
    num_output_tokens: int = 0


def run_latency(ns: argparse.Namespace) -> int:
    result = benchmark_latency(ns)
    print(format_result(result))
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


def _check(ns: argparse.Namespace) -> None:
    for flag in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}.")
    if ns.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {ns.num_iters_warmup}.")
    if ns.bandwidth_mib < 0:
        raise ValueError(f"--bandwidth-mib must be >= 0, got {ns.bandwidth_mib}.")


def run_batch(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> BatchTiming:
    """Submit ``prompts`` at once and step to completion, timing every step."""
    from pagellm.engine.output_processor import OutputKind
    from pagellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params, kind=OutputKind.DELTA)
    have_first: set[str] = set()
    first_output = prefill = None
    last = start
    timing = BatchTiming(0.0, 0.0, 0.0)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        timing.num_steps += 1
        new = sum(len(c.token_ids) for o in outs for c in o.outputs)
        timing.num_output_tokens += new
        if not new:
            continue  # time of a step without tokens goes to the next step that has some
        if prefill is not None:
            timing.decode_step_s.append(now - last)
        if first_output is None:
            first_output = now - start
        have_first.update(o.request_id for o in outs if any(c.token_ids for c in o.outputs))
        if prefill is None and len(have_first) == len(prompts):
            prefill = now - start
        last = now
    timing.latency_s = last - start
    timing.first_output_s = first_output if first_output is not None else timing.latency_s
    timing.prefill_s = prefill if prefill is not None else timing.latency_s
    return timing


def decode_weight_bytes(model: Any) -> tuple[int, int]:
    """(all parameter bytes, bytes a decode step reads): an input embedding table is only
    gathered row by row, so it counts unless it is also the (tied) LM head."""
    from pagellm.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    params = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    head_ids = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    gathered = {id(m.weight) for m in model.modules()
                if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    skipped = sum(params.get(i, 0) for i in gathered - head_ids)
    total = sum(params.values())
    return total, total - skipped


class ReadBandwidth:
    """Memory read bandwidth, sampled by summing a ``mib`` MiB float32 tensor (on CPU on 2 MiB
    pages, where the weights the kernels stream live: kernels/huge_pages.py; on 4 KiB pages the
    same sum reads up to 15% slower, which would lower the floor).

    On a shared host the bandwidth moves second to second (a 2-core Zen 4: mostly 30-34 GB/s
    with bursts near 50), so ``bench latency`` samples it after every timed iteration and the
    floor uses the median sample: the bandwidth the decode steps' mean ran at, not a burst."""

    def __init__(self, device: Any, mib: int) -> None:
        import torch

        n = mib * 2**20 // 4
        if torch.device(device).type == "cpu":
            from pagellm.kernels.huge_pages import empty_on_huge_pages

            self.x = empty_on_huge_pages((n,), torch.float32).fill_(1.0)
        else:
            self.x = torch.ones(n, dtype=torch.float32, device=device)
        self._sync = torch.cuda.synchronize if self.x.is_cuda else (lambda: None)
        self.x.sum()  # first touch / warm-up
        self._sync()
        self.samples: list[float] = []  # bytes/s

    def sample(self, repeats: int) -> None:
        for _ in range(repeats):
            t = time.perf_counter()
            self.x.sum()
            self._sync()
            self.samples.append(self.x.numel() * 4 / (time.perf_counter() - t))

    @property
    def median(self) -> float:
        return float(np.median(self.samples))


def measure_read_bandwidth(device: Any, mib: int, repeats: int = 5) -> float:
    """Bytes/s: the median of ``repeats`` samples (``ReadBandwidth``)."""
    probe = ReadBandwidth(device, mib)
    probe.sample(repeats)
    return probe.median


def _pct(values: list[float], scale: float = 1.0) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64) * scale
    out = {"avg": float(a.mean())}
    out.update({f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES})
    return out


def benchmark_latency(ns: argparse.Namespace) -> dict[str, Any]:
    from pagellm.engine.llm_engine import LLMEngine

    _check(ns)
    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    startup_s = time.perf_counter() - t0
    try:
        cfg = engine.config
        if ns.input_len + ns.output_len > cfg.scheduler.max_model_len:
            raise ValueError(f"--input-len + --output-len ({ns.input_len + ns.output_len}) "
                             f"exceeds --max-model-len ({cfg.scheduler.max_model_len}).")
        vocab = cfg.model.vocab_size
        n_total = ns.num_iters_warmup + ns.num_iters
        reqs = random_requests(n_total * ns.batch_size, ns.input_len, ns.output_len, vocab,
                               ns.seed)
        timings = []
        probe = ReadBandwidth(cfg.device.device, ns.bandwidth_mib) if ns.bandwidth_mib else None
        for it in range(n_total):
            prompts = [r.prompt_token_ids for r in reqs[it * ns.batch_size:
                                                        (it + 1) * ns.batch_size]]
            t = run_batch(engine, prompts, ns.output_len, f"it{it}")
            if it >= ns.num_iters_warmup:
                timings.append(t)
                if probe is not None:
                    probe.sample(_BANDWIDTH_SAMPLES_PER_ITER)  # as the machine is right now
        runner = getattr(engine.engine_core.executor, "runner", None)  # None with TP workers
        weights = decode_weight_bytes(runner.model) if runner is not None else None
        bandwidth = probe.median if probe is not None else None
    finally:
        engine.shutdown()
    steps = [s for t in timings for s in t.decode_step_s]
    result: dict[str, Any] = {
        "input_len": ns.input_len, "output_len": ns.output_len, "batch_size": ns.batch_size,
        "num_iters_warmup": ns.num_iters_warmup, "num_iters": ns.num_iters,
        "dtype": str(cfg.model.dtype).removeprefix("torch."), "device": str(cfg.device.device),
        "startup_s": startup_s,
        "latencies_s": [t.latency_s for t in timings],
        "avg_latency_s": float(np.mean([t.latency_s for t in timings])),
        "latency_s": _pct([t.latency_s for t in timings]),
        "first_output_ms": _pct([t.first_output_s for t in timings], 1e3),
        "prefill_ms": _pct([t.prefill_s for t in timings], 1e3),
        "decode_ms_per_step": _pct(steps, 1e3) if steps else None,
        "num_decode_steps": [len(t.decode_step_s) for t in timings],
        "num_steps": [t.num_steps for t in timings],
        "num_output_tokens": [t.num_output_tokens for t in timings],
    }
    if weights is not None:
        result.update(param_bytes=weights[0], decode_weight_bytes_per_step=weights[1])
    if bandwidth is not None:
        result["read_bandwidth_gb_s"] = bandwidth / 1e9
        result["read_bandwidth_samples_gb_s"] = [b / 1e9 for b in probe.samples]
    if weights is not None and bandwidth is not None:
        floor_ms = weights[1] / bandwidth * 1e3
        result["decode_floor_ms_per_step"] = floor_ms
        if steps:
            result["decode_vs_floor"] = result["decode_ms_per_step"]["avg"] / floor_ms
    return result


def format_result(r: dict[str, Any]) -> str:
    w = 34
    lines = ["{:=^64}".format(" Latency Benchmark Result "),
             f"{'Batch size / input / output:':<{w}}{r['batch_size']} x "
             f"({r['input_len']} + {r['output_len']} tokens), {r['dtype']} on {r['device']}",
             f"{'Timed iterations:':<{w}}{r['num_iters']} (after {r['num_iters_warmup']} "
             "warm-up)",
             f"{'Start-up (s):':<{w}}{r['startup_s']:.2f}",
             f"{'':<{w}}{'avg':>9}{'p50':>9}{'p90':>9}{'p99':>9}"]
    rows = [("Batch latency (ms)", {k: v * 1e3 for k, v in r["latency_s"].items()}),
            ("First output (ms)", r["first_output_ms"]), ("Prefill, whole batch (ms)",
                                                           r["prefill_ms"])]
    if r["decode_ms_per_step"]:
        rows.append(("Decode per token (ms)", r["decode_ms_per_step"]))
    for name, s in rows:
        lines.append(f"{name + ':':<{w}}" + "".join(f"{s[k]:>9.2f}"
                                                      for k in ("avg", "p50", "p90", "p99")))
    if "decode_weight_bytes_per_step" in r:
        lines.append(f"{'Weights read per decode step:':<{w}}"
                     f"{r['decode_weight_bytes_per_step'] / 2**20:.1f} MiB")
    if "read_bandwidth_gb_s" in r:
        samples = r.get("read_bandwidth_samples_gb_s") or [r["read_bandwidth_gb_s"]]
        lines.append(f"{'Memory read bandwidth:':<{w}}{r['read_bandwidth_gb_s']:.1f} GB/s "
                     f"(median of {len(samples)}, {min(samples):.0f}-{max(samples):.0f})")
    if "decode_vs_floor" in r:
        who = "batch-1 decode" if r["batch_size"] == 1 else f"batch-{r['batch_size']} decode"
        lines.append(f"{who} {r['decode_ms_per_step']['avg']:.2f} ms/token vs floor "
                     f"{r['decode_floor_ms_per_step']:.2f} ms/token "
                     f"({r['decode_vs_floor']:.2f}x)")
    lines.append("=" * 64)
    return "\n".join(lines)


__all__ = ["BatchTiming", "add_latency_parser", "benchmark_latency", "decode_weight_bytes",
           "format_result", "measure_read_bandwidth", "run_batch", "run_latency"]
