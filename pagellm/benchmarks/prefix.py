"""``pagellm bench prefix``: the shared-prefix workload with prefix caching off, then on.

Default workload (``prefix`` in the shared bench workloads): 64 requests sharing a 1,024-token
prefix plus 32-64 unique tokens each, 32 output tokens each (EOS ignored), all submitted at once.
Both engines are built in this one process, one after the other, with the same flags except
``--enable-prefix-caching``; the report gives prompt tokens actually computed (prefill), time,
time to first token and the on/off ratios, as text and (``--output-json``) JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import time
from typing import Any

from pagellm.benchmarks.workload import BenchRequest, load_jsonl, parse_range
from pagellm.engine_args import EngineArgs


def add_prefix_parser(sub: Any) -> None:
    p = sub.add_parser("prefix", help="shared-prefix workload, prefix caching off vs on")
    EngineArgs.add_cli_args(p)
    p.add_argument("--dataset", default=None,
                   help="JSONL of prompt_token_ids (or prompt) + max_tokens, instead of the "
                        "generated workload")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens")
    p.add_argument("--suffix-len", default="32-64", help="unique tokens per request: N or LO-HI")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request")
    p.add_argument("--workload-seed", type=int, default=1234)
    p.add_argument("--output-json", default=None, help="also write the result as JSON here")
    p.set_defaults(func=run_prefix)


def shared_prefix_requests(num_prompts: int, prefix_len: int, suffix_len: str | int,
                           output_len: int, vocab_size: int, seed: int = 1234
                           ) -> list[BenchRequest]:
    """``num_prompts`` prompts = one random ``prefix_len``-token prefix + unique random tokens."""
    if num_prompts < 1 or prefix_len < 0 or output_len < 1:
        raise ValueError("--num-prompts and --output-len must be >= 1 and --prefix-len >= 0.")
    lo, hi = parse_range(suffix_len, "--suffix-len")
    rng = random.Random(seed)
    lo_id = min(1000, vocab_size // 4)  # clear of the lowest ids, usually special tokens

    def draw(n: int) -> list[int]:
        return [rng.randrange(lo_id, vocab_size) for _ in range(n)]

    prefix = draw(prefix_len)
    return [BenchRequest(prefix + draw(rng.randint(lo, hi)), output_len)
            for _ in range(num_prompts)]


def run_prefix(ns: argparse.Namespace) -> int:
    result = benchmark_prefix(ns)
    print(format_result(result))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            f.write(json.dumps(result) + "\n")
    return 0


def benchmark_prefix(ns: argparse.Namespace) -> dict[str, Any]:
    base = EngineArgs.from_cli_args(ns)
    reqs: list[BenchRequest] | None = None
    runs: dict[str, dict[str, Any]] = {}
    tokens: dict[str, list[list[int]]] = {}
    info: dict[str, Any] = {}
    for name, caching in (("caching_off", False), ("caching_on", True)):
        args = dataclasses.replace(base, enable_prefix_caching=caching)
        runs[name], tokens[name], reqs, info = _run_one(args, reqs, ns)
        gc.collect()  # free the first engine's KV cache before the second one allocates
    off, on = runs["caching_off"], runs["caching_on"]
    assert reqs is not None
    return {
        **info,
        "num_requests": len(reqs),
        "prefix_len": None if ns.dataset else ns.prefix_len,
        "caching_off": off, "caching_on": on,
        "speedup": _ratio(off["elapsed_s"], on["elapsed_s"]),
        "ttft_mean_speedup": _ratio(off["ttft_mean_s"], on["ttft_mean_s"]),
        "prefill_reduction": _ratio(off["prefill_tokens_computed"],
                                    on["prefill_tokens_computed"]),
        # Greedy outputs with caching on equal those with it off (exactly in fp32; bf16/fp16
        # may round a cached prefix differently from a recomputed one).
        "outputs_match": sum(a == b for a, b in zip(tokens["caching_off"], tokens["caching_on"],
                                                     strict=True)),
    }


def _run_one(args: Any, reqs: list[BenchRequest] | None, ns: argparse.Namespace
             ) -> tuple[dict[str, Any], list[list[int]], list[BenchRequest], dict[str, Any]]:
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    startup_s = time.perf_counter() - t0
    vocab = engine.config.model.vocab_size
    if reqs is None:
        reqs = (load_jsonl(ns.dataset, engine.tokenizer) if ns.dataset else
                shared_prefix_requests(ns.num_prompts, ns.prefix_len, ns.suffix_len,
                                       ns.output_len, vocab, ns.workload_seed))
    # Warm-up on unrelated tokens, then forget them: the timed run starts from a cold cache.
    engine.add_request("warmup", {"prompt_token_ids": [vocab // 2] * 64},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    core = engine.engine_core
    prompt_before, stats_before = core.stats.num_prompt_tokens, core.make_stats()

    start = time.perf_counter()
    for i, r in enumerate(reqs):
        engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                          ignore_eos=True))
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    elapsed = time.perf_counter() - start
    stats = core.make_stats()
    outs = [finished[str(i)] for i in range(len(reqs))]
    ttfts = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    run = {
        "elapsed_s": round(elapsed, 3),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
        "prefill_tokens_computed": core.stats.num_prompt_tokens - prompt_before,
        "prefix_cache_hit_tokens": stats.prefix_cache_hits - stats_before.prefix_cache_hits,
        "num_cached_tokens_reported": sum(o.num_cached_tokens for o in outs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_max_s": round(max(ttfts), 4),
        "num_preemptions": stats.num_preemptions - stats_before.num_preemptions,
        "startup_s": round(startup_s, 2),
    }
    run["output_tokens_per_s"] = round(run["output_tokens"] / elapsed, 1)
    info = {
        "model": engine.config.model.served_model_name,
        "dtype": str(engine.config.model.dtype).removeprefix("torch."),
        "device": str(engine.config.device.device),
        "block_size": engine.config.cache.block_size,
        "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
        "num_kv_blocks": core.num_blocks,
    }
    tokens = [o.outputs[0].token_ids for o in outs]
    engine.shutdown()
    return run, tokens, reqs, info


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def format_result(r: dict[str, Any]) -> str:
    lines = [f"Prefix caching benchmark: {r['num_requests']} requests"
             + (f" sharing a {r['prefix_len']}-token prefix" if r["prefix_len"] else "")
             + f"; {r['model']}, {r['dtype']} on {r['device']}, block size {r['block_size']}"]
    for name in ("caching_off", "caching_on"):
        s = r[name]
        lines.append(
            f"  {name.replace('_', ' '):<12} prefill {s['prefill_tokens_computed']:>7} of "
            f"{s['prompt_tokens']} prompt tokens computed ({s['prefix_cache_hit_tokens']} from "
            f"cache), {s['elapsed_s']:.2f} s, TTFT mean {s['ttft_mean_s']:.3f} s / p50 "
            f"{s['ttft_p50_s']:.3f} s, {s['output_tokens_per_s']:.1f} output tok/s, "
            f"{s['num_preemptions']} preemptions")
    lines.append(f"  on vs off: {r['speedup']}x faster end to end, TTFT mean "
                 f"{r['ttft_mean_speedup']}x lower, {r['prefill_reduction']}x fewer prefill "
                 f"tokens; identical greedy outputs for {r['outputs_match']}/"
                 f"{r['num_requests']} requests")
    return "\n".join(lines)
