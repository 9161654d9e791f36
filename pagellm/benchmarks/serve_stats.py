"""Statistics for ``pagellm bench serve``: per-request records, one run's summary, whether a
request rate was sustained, and the request-rate sweep (its JSON, its table, reading it back).

A rate is **sustained** when all four hold (``SUSTAINED_DEFINITION``, also written into the JSON):
1. no request failed;
2. achieved request throughput (completed / whole run, from the first send to the last answer)
   is at least 90% of the offered rate, where the offered rate allows for the run's drain tail:
   ``num_prompts / (arrival span + median e2e latency of the first third of requests)``, the
   throughput a server with no queueing would show on this very sample of Poisson arrivals
   (without the tail term, short runs would never count as sustained);
3. TTFT is not growing across the run: the median TTFT of the last third of requests (by arrival)
   is at most twice that of the first third, or at most 100 ms above it (a backlog that builds up
   shows as TTFT rising with arrival order);
4. latency SLOs hold: p99 TTFT <= ``slo_ttft_s`` (default 2 s) and p99 TPOT <= ``slo_tpot_s``
   (default 200 ms). A continuously batching server with room for every request admits them
   all at once, so overload shows as every stream slowing down (TPOT), not as a queue: 2. and 3.
   alone can pass a server that keeps a fifth of the offered rate.
Judged only for finite rates with at least 3 requests; runs must last several e2e latencies for
the verdict to mean much.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SUSTAINED_THROUGHPUT_FRACTION = 0.9
SUSTAINED_TTFT_GROWTH = 2.0
SUSTAINED_TTFT_SLACK_S = 0.1
DEFAULT_SLO_TTFT_S = 2.0
DEFAULT_SLO_TPOT_S = 0.2
SUSTAINED_DEFINITION = (
    "no failed request; request_throughput >= 0.9 x offered, offered = num_prompts / (arrival "
    "span + median e2e of the first third); median TTFT of the last third of requests (by "
    "arrival) <= max(2 x, +100 ms) that of the first third; p99 TTFT <= slo_ttft and p99 TPOT "
    "<= slo_tpot (defaults 2000 ms / 200 ms)")


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0
    arrival: float = 0.0  # seconds from the run's start until the request was due


def stats_ms(values: list[float]) -> dict[str, float]:
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
        "ttft_ms": stats_ms([r.ttft for r in ok]), "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([x for r in ok for x in r.itls]),
        "e2e_latency_ms": stats_ms([r.e2e for r in ok]),
    }


def judge_sustained(results: list[RequestResult], rate: float, request_throughput: float,
                    slo_ttft_s: float = DEFAULT_SLO_TTFT_S,
                    slo_tpot_s: float = DEFAULT_SLO_TPOT_S) -> dict[str, Any]:
    """The verdict and the quantities behind it (see the module docstring)."""
    verdict: dict[str, Any] = {"sustained": None}
    n = len(results)
    if not math.isfinite(rate) or n < 3:
        return verdict
    by_arrival = sorted(results, key=lambda r: r.arrival)
    third = n // 3
    first, last = by_arrival[:third], by_arrival[-third:]
    failed = sum(not r.success for r in results)

    def p50(rs: list[RequestResult], attr: str) -> float:
        vals = [getattr(r, attr) for r in rs if r.success]
        return float(np.median(vals)) if vals else math.inf

    span = by_arrival[-1].arrival - by_arrival[0].arrival
    e2e_first = p50(first, "e2e")
    offered = n / (span + e2e_first) if math.isfinite(e2e_first) else math.inf
    ttft_first, ttft_last = p50(first, "ttft"), p50(last, "ttft")
    ttft_ok = (ttft_last <= SUSTAINED_TTFT_GROWTH * ttft_first
               or ttft_last - ttft_first <= SUSTAINED_TTFT_SLACK_S)
    tput_ok = request_throughput >= SUSTAINED_THROUGHPUT_FRACTION * offered
    ok = [r for r in results if r.success]
    ttft_p99 = float(np.percentile([r.ttft for r in ok], 99)) if ok else math.inf
    tpots = [(r.e2e - r.ttft) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    tpot_p99 = float(np.percentile(tpots, 99)) if tpots else 0.0
    slo_ok = ttft_p99 <= slo_ttft_s and tpot_p99 <= slo_tpot_s
    verdict.update(
        sustained=bool(failed == 0 and tput_ok and ttft_ok and slo_ok),
        ttft_p99_ms=ttft_p99 * 1e3, tpot_p99_ms=tpot_p99 * 1e3,
        slo_ttft_ms=slo_ttft_s * 1e3, slo_tpot_ms=slo_tpot_s * 1e3,
        offered_rate_realized=(n - 1) / span if span > 0 else math.inf,
        offered_rate_with_tail=offered,
        throughput_ratio=request_throughput / offered if offered > 0 else 0.0,
        ttft_median_first_third_ms=ttft_first * 1e3, ttft_median_last_third_ms=ttft_last * 1e3)
    return {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
            for k, v in verdict.items()}


def make_sweep(runs: list[dict[str, Any]], label: str, config: dict[str, Any]) -> dict[str, Any]:
    """The JSON written by a sweep: every rate's summary plus the highest sustained rate."""
    sustained = [r["request_rate"] for r in runs
                 if isinstance(r["request_rate"], (int, float)) and r.get("sustained")]
    first = runs[0] if runs else {}
    return {"label": label, "model": first.get("model"), "base_url": first.get("base_url"),
            "endpoint": first.get("endpoint"), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "config": config, "sustained_definition": SUSTAINED_DEFINITION,
            "max_sustained_rate": max(sustained) if sustained else None, "runs": runs}


def load_sweep(path: str) -> dict[str, Any]:
    """A sweep JSON, or a single-rate ``bench serve`` JSON (read as a one-rate sweep)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if "runs" in data:
        return data
    if "ttft_ms" not in data:
        raise ValueError(f"--plot-compare {path}: not a `pagellm bench serve` JSON.")
    return make_sweep([data], data.get("label") or data.get("model") or path, {})


def format_summary(s: dict[str, Any]) -> str:
    w = 40
    lines = ["{:=^60}".format(" Serving Benchmark Result "),
             f"{'Request rate (req/s):':<{w}}{s.get('request_rate', 'inf')}",
             f"{'Successful requests:':<{w}}{s['completed']}",
             f"{'Failed requests:':<{w}}{s['failed']}",
             f"{'Benchmark duration (s):':<{w}}{s['duration_s']:.2f}",
             f"{'Total input tokens:':<{w}}{s['total_input_tokens']}",
             f"{'Total generated tokens:':<{w}}{s['total_output_tokens']}",
             f"{'Request throughput (req/s):':<{w}}{s['request_throughput']:.2f}",
             f"{'Output token throughput (tok/s):':<{w}}{s['output_throughput']:.2f}",
             f"{'Total token throughput (tok/s):':<{w}}{s['total_token_throughput']:.2f}"]
    if s.get("sustained") is not None:
        lines.append(f"{'Sustained:':<{w}}{'yes' if s['sustained'] else 'no'}")
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


def format_sweep_table(sweep: dict[str, Any]) -> str:
    head = (f"{'rate':>6} {'done':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'E2E p50':>9} {'E2E p99':>9} "
            f"{'sustained':>9}")
    lines = [f"Sweep: {sweep['label']} (latencies in ms)", head]
    for r in sweep["runs"]:
        sus = {True: "yes", False: "no", None: "-"}[r.get("sustained")]
        lines.append(f"{r['request_rate']!s:>6} {r['completed']:>5} "
                     f"{r['request_throughput']:>7.2f} {r['output_throughput']:>9.1f} "
                     f"{r['ttft_ms']['median']:>9.1f} "
                     f"{r['ttft_ms']['p99']:>9.1f} {r['tpot_ms']['median']:>9.1f} "
                     f"{r['tpot_ms']['p99']:>9.1f} {r['e2e_latency_ms']['median']:>9.1f} "
                     f"{r['e2e_latency_ms']['p99']:>9.1f} {sus:>9}")
    lines.append(f"Highest sustained rate: {sweep['max_sustained_rate']}")
    return "\n".join(lines)


__all__ = ["SUSTAINED_DEFINITION", "RequestResult", "format_summary", "format_sweep_table",
           "judge_sustained", "load_sweep", "make_sweep", "stats_ms", "summarize"]
