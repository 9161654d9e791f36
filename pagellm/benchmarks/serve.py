"""``pagellm bench serve``: an async load generator for any OpenAI-compatible server.

Requests arrive as a Poisson process (``--request-rate``, inf = all at once), at most
``--max-concurrency`` in flight, all streaming. Several rates (``--request-rate 2,4,8``) run one
after another against the same server (a sweep: one JSON, optionally one ``--plot`` PNG, which
``--plot-compare`` can share with other servers' sweeps); each finite rate is judged sustained or
not (definition in serve_stats.py). Reported per request: TTFT (time to the first
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
from typing import Any

from pagellm.benchmarks.serve_client import (
    BenchRequest,
    arrival_intervals,
    benchmark,
    load_dataset,
)
from pagellm.benchmarks.serve_stats import (
    RequestResult,
    format_summary,
    format_sweep_table,
    load_sweep,
    make_sweep,
    summarize,
)
from pagellm.config import read_env


def parse_rates(text: str) -> list[float]:
    """'2,4,8' -> [2.0, 4.0, 8.0]; 'inf' sends all at once."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request-rate: numbers or inf, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--request-rate must be > 0 (or inf), got {text!r}")
    return rates


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
    p.add_argument("--num-prompts", type=int, default=100, help="per request rate")
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len x (1 - r), len x (1 + r)], 0 <= r < 1")
    p.add_argument("--random-vocab-size", type=int, default=10000,
                   help="random token ids are drawn below this")
    p.add_argument("--request-rate", type=parse_rates, action="append", default=None,
                   help="requests per second (Poisson arrivals); inf sends all at once. A list "
                        "(2,4,8) or a repeated flag runs a sweep against the same server")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos so every request generates max_tokens")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="untimed requests sent one at a time before each rate's run")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0,
                   help="a rate counts as sustained only if p99 TTFT stays under this")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0,
                   help="a rate counts as sustained only if p99 TPOT stays under this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    p.add_argument("--label", default=None, help="name of this server in the JSON and plot "
                   "(default: the model name)")
    p.add_argument("--output-json", default=None, help="also write the results here")
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="draw latency percentiles and throughput against request rate")
    p.add_argument("--plot-compare", nargs="+", action="extend", default=[], metavar="JSON",
                   help="other `bench serve` JSONs (other servers) to draw on the same plot")
    p.add_argument("--plot-only", action="store_true",
                   help="run nothing: draw --plot from the --plot-compare JSONs")
    p.set_defaults(func=run_bench_serve)
    return p


def run_bench_serve(ns: argparse.Namespace) -> int:
    """The ``pagellm bench serve`` command: prints the report (and writes --output-json)."""
    bench_serve(ns)
    return 0


def _check(ns: argparse.Namespace) -> list[float]:
    if ns.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not 0.0 <= ns.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if ns.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    if ns.plot_only and not (ns.plot and ns.plot_compare):
        raise ValueError("--plot-only needs --plot and --plot-compare")
    rate_lists = ns.request_rate if ns.request_rate is not None else [[math.inf]]
    return [r for rates in rate_lists for r in rates]


def bench_serve(ns: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by the parsed flags. Returns (and writes to --output-json)
    the summary for a single rate, or the sweep ({"runs": [summary per rate], ...}) for several.
    """
    rates = _check(ns)
    others = [load_sweep(path) for path in ns.plot_compare]
    if ns.plot_only:
        from pagellm.benchmarks.serve_plot import plot_sweeps

        plot_sweeps(others, ns.plot)
        return {}
    env = read_env()
    api_key = ns.api_key or env.api_key or env.openai_api_key
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    runs = []
    for i, rate in enumerate(rates):
        # Fresh prompts per rate (no prefix-cache hits between rates), the same for every server.
        requests = load_dataset(ns.dataset, ns.num_prompts, ns.random_input_len,
                                ns.random_output_len, ns.random_vocab_size,
                                ns.random_range_ratio, ns.seed + i)
        summary = asyncio.run(benchmark(
            ns.base_url, requests, model=ns.model, endpoint=ns.endpoint, request_rate=rate,
            max_concurrency=ns.max_concurrency, api_key=api_key, ignore_eos=ns.ignore_eos,
            seed=ns.seed + i, timeout_s=ns.timeout, num_warmups=ns.num_warmups,
            slo_ttft_s=ns.slo_ttft_ms / 1e3, slo_tpot_s=ns.slo_tpot_ms / 1e3))
        print(format_summary(summary), flush=True)
        runs.append(summary)
    config = {k: getattr(ns, k) for k in (
        "dataset", "num_prompts", "random_input_len", "random_output_len", "random_range_ratio",
        "max_concurrency", "ignore_eos", "seed", "num_warmups", "endpoint", "slo_ttft_ms",
        "slo_tpot_ms")}
    sweep = make_sweep(runs, ns.label or runs[0]["model"], config)
    if len(runs) > 1:
        print(format_sweep_table(sweep))
    result = sweep if len(runs) > 1 else dict(runs[0], label=sweep["label"])
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if ns.plot:
        from pagellm.benchmarks.serve_plot import plot_sweeps

        plot_sweeps([*others, sweep], ns.plot)
    return result


__all__ = ["BenchRequest", "RequestResult", "add_bench_serve_parser", "arrival_intervals",
           "bench_serve", "benchmark", "load_dataset", "parse_rates", "run_bench_serve",
           "summarize"]
