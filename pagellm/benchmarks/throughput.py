"""``pagellm bench throughput``: offline throughput, every request generated in full."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagellm.benchmarks.structured import run_requests
from pagellm.benchmarks.workload import load_jsonl, random_requests
from pagellm.engine_args import EngineArgs


def add_throughput_parser(sub: Any) -> None:
    p = sub.add_parser("throughput", help="offline throughput (requests/s, tokens/s)")
    EngineArgs.add_cli_args(p)
    p.add_argument("--dataset", default=None, help="JSONL of prompt_token_ids + max_tokens")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="256", help="N or LO-HI (random prompts)")
    p.add_argument("--output-len", default="128", help="N or LO-HI (random prompts)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before timing")
    p.add_argument("--output-json", default=None, help="also write the result as JSON here")
    p.add_argument("--structured-output", choices=("none", "json"), default="none",
                   help="json: run the workload again with every request under a typical JSON "
                   "schema and print the throughput ratio and the schema's compile times")
    p.set_defaults(func=run_throughput)


def run_throughput(ns: argparse.Namespace) -> int:
    result = benchmark_throughput(ns)
    print(format_result(result))
    if "structured" in result:
        from pagellm.benchmarks.structured import format_structured

        print(format_structured(result["structured"]))
    line = json.dumps(result)
    print(line)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            f.write(line + "\n")
    return 0


def benchmark_throughput(ns: argparse.Namespace) -> dict[str, Any]:
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(ns))
    startup_s = time.perf_counter() - t0
    vocab = engine.config.model.vocab_size
    if ns.dataset:
        reqs = load_jsonl(ns.dataset, engine.tokenizer)
    else:
        reqs = random_requests(ns.num_prompts, ns.input_len, ns.output_len, vocab, ns.seed)
    for i in range(ns.warmup):
        engine.add_request(f"warmup-{i}", {"prompt_token_ids": reqs[0].prompt_token_ids[:64]},
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    elapsed, num_out = run_requests(
        engine, reqs, lambda r: SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                               ignore_eos=True), "")
    num_in = sum(len(r.prompt_token_ids) for r in reqs)
    stats = engine.engine_core.make_stats()
    structured = {}
    if getattr(ns, "structured_output", "none") == "json":
        from pagellm.benchmarks.structured import benchmark_structured

        structured = {"structured": benchmark_structured(engine, reqs, elapsed, num_out)}
    return {
        "num_requests": len(reqs), "elapsed_s": round(elapsed, 3),
        "prompt_tokens": num_in, "output_tokens": num_out,
        "requests_per_s": round(len(reqs) / elapsed, 3),
        "total_tokens_per_s": round((num_in + num_out) / elapsed, 1),
        "output_tokens_per_s": round(num_out / elapsed, 1),
        "num_preemptions": stats.num_preemptions, "startup_s": round(startup_s, 2),
        "dtype": str(engine.config.model.dtype).removeprefix("torch."),
        "device": str(engine.config.device.device),
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "num_kv_blocks": engine.engine_core.num_blocks,
        **structured,
    }


def format_result(r: dict[str, Any]) -> str:
    return (f"Throughput: {r['requests_per_s']:.2f} requests/s, "
            f"{r['total_tokens_per_s']:.1f} total tokens/s, "
            f"{r['output_tokens_per_s']:.1f} output tokens/s "
            f"({r['num_requests']} requests, {r['prompt_tokens']} prompt + "
            f"{r['output_tokens']} output tokens in {r['elapsed_s']:.1f} s; "
            f"{r['dtype']} on {r['device']}, start-up {r['startup_s']:.1f} s)")
