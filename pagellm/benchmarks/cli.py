"""``pagellm bench throughput|latency|prefix|serve``."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    from pagellm.benchmarks.throughput import add_throughput_parser

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_throughput_parser(bench_sub)
    for module, adder in (("pagellm.benchmarks.latency", "add_latency_parser"),
                          ("pagellm.benchmarks.prefix", "add_prefix_parser"),
                          ("pagellm.benchmarks.serve", "add_bench_serve_parser")):
        try:
            mod = __import__(module, fromlist=[adder])
        except ImportError:
            continue
        getattr(mod, adder)(bench_sub)


__all__ = ["add_bench_parser", "argparse"]
