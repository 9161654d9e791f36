"""``pagellm plan [MODEL] [engine flags] [--device TARGET] ...``: memory and capacity from the
config alone. Exit status 0 when the configuration fits, 1 when it does not, 2 on bad input."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagellm.engine_args import EngineArgs


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="explain memory and capacity before loading anything",
        description="Read MODEL's config (HF folder, config.json, or GGUF header; no weights) and "
                    "print, per rank: weights, activation and overhead estimates, KV bytes per "
                    "token, KV budget, blocks, token capacity, max concurrency at max_model_len, "
                    "whether it fits, and the nearest settings that do. Same flags as serve.")
    # --device and --quantization mean the target and a what-if here (the plan group's).
    # A plan is one engine's: data parallelism runs copies of it (docs/parallelism.md).
    EngineArgs.add_cli_args(parser, exclude=("device", "quantization", "data_parallel_size",
                                             "data_parallel_rank"))
    g = parser.add_argument_group("plan")
    g.add_argument("--device", default="auto",
                   help="target: cpu, cuda[:N] (a GPU here), a GPU name (h100, h200, a100-80gb, "
                        "a100-40gb, l40s, a10g, l4, rtx4090) or one GPU's memory (80GiB); "
                        "tensor parallel ranks get one each (default: auto)")
    g.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization to plan for (a what-if)")
    g.add_argument("--json", action="store_true", help="print the plan as JSON")
    g.add_argument("--from-metrics", metavar="URL", default=None,
                   help="a running server's /metrics: size --max-model-len and --max-num-seqs "
                        "from its request length histograms")
    g.add_argument("--from-log", metavar="FILE", default=None,
                   help="JSONL {\"prompt_tokens\": N, \"output_tokens\": M} per request (or "
                        "'prompt_tokens=N output_tokens=M' lines): same, from exact lengths")
    g.add_argument("--quantile", type=float, default=0.99,
                   help="share of observed requests --max-model-len must admit (default 0.99)")
    parser.set_defaults(func=run_plan)
    return parser


def _traffic(ns: argparse.Namespace, report: Any) -> Any:
    from pagellm.planning import recommend, traffic

    if not 0.0 < ns.quantile <= 1.0:
        raise ValueError(f"--quantile must be in (0, 1], got {ns.quantile}.")
    s, kv = report.settings, report.ranks[0].kv
    context = report.spec.context_len
    if ns.from_log:
        rows = traffic.read_length_log(ns.from_log)
        return recommend.advise_from_lengths([p + o for p, o in rows], ns.quantile, s.block_size,
                                             context, kv.num_blocks, f"log {ns.from_log}")
    prompt, output = traffic.fetch_length_histograms(ns.from_metrics)
    return recommend.advise_from_histograms(prompt, output, ns.quantile, s.block_size, context,
                                            kv.num_blocks, f"metrics {ns.from_metrics}")


def run_plan(ns: argparse.Namespace) -> int:
    from pagellm.planning.planner import plan_from_args
    from pagellm.planning.recommend import suggest
    from pagellm.planning.report import format_report

    if ns.from_log and ns.from_metrics:
        raise ValueError("give --from-log or --from-metrics, not both.")
    args = EngineArgs.from_cli_args(ns)
    report = plan_from_args(args, ns.device, ns.quantization)
    report.suggestions = suggest(report.spec, report.device, report.settings, report.ranks[0])
    if ns.from_log or ns.from_metrics:
        report.traffic = _traffic(ns, report)
    if ns.json:
        json.dump(report.as_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0 if report.fits else 1
