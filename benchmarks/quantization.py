"""Weight-only quantization side by side: weight memory, decode tokens/s at batch 1 and 64, and
offline throughput for bf16 / int8 / int4 on this machine, in one run.

    .venv/bin/python benchmarks/quantization.py                 # default model, bf16/int8/int4
    .venv/bin/python benchmarks/quantization.py --variants none,int8,int4,int4-g128 --rounds 3
    .venv/bin/python benchmarks/quantization.py --sweep-rows    # CPU ops vs dequantize + matmul

All engines are built first, then measured round-robin (best of ``--rounds``), so load from other
processes on a shared machine hits every variant alike. Ratios are against the first variant.
Decode tokens/s: ``batch * (N - 1) / (t(N tokens) - t(1 token))`` for the same prompts, so
prefill is subtracted out.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch
import torch.nn.functional as F

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.workload import random_requests


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default="none,int8,int4",
                   help="comma-separated --quantization values; the first is the baseline")
    p.add_argument("--rounds", type=int, default=2, help="best of this many rounds")
    p.add_argument("--prompt-len", type=int, default=32, help="decode benchmarks: prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode benchmarks: N")
    p.add_argument("--batches", default="1,64", help="decode batch sizes")
    p.add_argument("--num-prompts", type=int, default=64, help="offline throughput requests")
    p.add_argument("--input-len", default="32-256")
    p.add_argument("--output-len", default="32-96")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 is steadier on a shared machine")
    p.add_argument("--output-json", default=None)
    p.add_argument("--sweep-rows", action="store_true",
                   help="only time the CPU kernels against dequantize + matmul per row count")
    return p.parse_args()


def _runner(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.executor.runner  # tp=1: the in-process runner


def _timed(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, int]:
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    start = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def measure_round(llm: LLM, ns: argparse.Namespace, vocab: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(ns.seed)
    out: dict[str, float] = {}
    for batch in (int(b) for b in ns.batches.split(",")):
        prompts = torch.randint(3, vocab, (batch, ns.prompt_len), generator=g).tolist()
        t1, _ = _timed(llm, prompts, [1] * batch)
        tn, _ = _timed(llm, prompts, [ns.decode_tokens] * batch)
        out[f"decode_tok_s_bs{batch}"] = batch * (ns.decode_tokens - 1) / max(tn - t1, 1e-9)
    reqs = random_requests(ns.num_prompts, ns.input_len, ns.output_len, vocab, ns.seed)
    elapsed, num_out = _timed(llm, [r.prompt_token_ids for r in reqs],
                              [r.max_tokens for r in reqs])
    num_in = sum(len(r.prompt_token_ids) for r in reqs)
    out["offline_output_tok_s"] = num_out / elapsed
    out["offline_total_tok_s"] = (num_in + num_out) / elapsed
    return out


def run_engines(ns: argparse.Namespace) -> dict[str, dict[str, float]]:
    variants = [v.strip() for v in ns.variants.split(",")]
    llms: dict[str, LLM] = {}
    results: dict[str, dict[str, float]] = {}
    for v in variants:
        llm = LLM(model=ns.model, dtype=ns.dtype, quantization=None if v == "none" else v,
                  kv_cache_memory=ns.kv_cache_memory, max_model_len=ns.max_model_len,
                  seed=ns.seed, max_num_seqs=max(64, *(int(b) for b in ns.batches.split(","))))
        llms[v] = llm
        results[v] = {"weight_MiB": _runner(llm).weight_bytes / 2**20,
                      "kv_blocks": float(_runner(llm).num_blocks)}
        _timed(llm, [[5] * 16], [4])  # warm-up
    vocab = llms[variants[0]].llm_engine.config.model.vocab_size
    for r in range(ns.rounds):
        for v in variants:
            res = measure_round(llms[v], ns, vocab)
            print(f"round {r + 1} {v}: " + ", ".join(f"{k}={x:.1f}" for k, x in res.items()),
                  flush=True)
            for k, x in res.items():
                results[v][k] = max(results[v].get(k, 0.0), x)
    del llms
    gc.collect()
    return results


def format_table(results: dict[str, dict[str, float]]) -> str:
    variants = list(results)
    base = results[variants[0]]
    keys = list(base)
    lines = ["| metric | " + " | ".join(variants) + " |",
             "|---|" + "---|" * len(variants)]
    for k in keys:
        cells = []
        for v in variants:
            x = results[v][k]
            ratio = f" ({x / base[k]:.2f}x)" if v != variants[0] and base[k] else ""
            cells.append(f"{x:.1f}{ratio}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interleaved_best_us(fns: dict[str, Any], rounds: int = 20, reps: int = 2) -> dict[str, float]:
    """Best time per call of each function, calling them round-robin: on a shared machine, load
    from other processes then hits every variant alike instead of one phase of the run."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps * 1e6)
    return best


def _sweep_fns(x: torch.Tensor, weight: torch.Tensor, l8: Any, l4: Any) -> dict[str, Any]:
    dt, m4 = x.dtype, l4.quant_method
    return {
        "bf16": lambda: F.linear(x, weight),
        "int8 op": lambda: torch._weight_int8pack_mm(x, l8.qweight, l8.scales),
        "int8 deq": lambda: F.linear(x, l8.qweight.to(dt)) * l8.scales,
        "int4 op": lambda: torch._weight_int4pack_mm_for_cpu(x, l4.qweight, m4.group_size,
                                                             l4.scales_and_zeros),
        "int4 deq": lambda: torch.mm(x, m4._weight_t(l4, dt)),
    }


@torch.inference_mode()
def sweep_rows(ns: argparse.Namespace) -> None:
    """Per row count: bf16 F.linear vs the weight-only ops vs dequantize + F.linear."""
    from pagellm.layers.linear import ReplicatedLinear
    from pagellm.layers.quantization import parse_quantization

    dt = torch.bfloat16
    shapes = [(3072, 576), (576, 1536)]  # SmolLM2's gate_up and down projections
    print(f"torch threads: {torch.get_num_threads()}; microseconds per call, best of 20 rounds")
    print("| N x K | rows | bf16 linear | int8 op | int8 dequant | int4 op | int4 dequant |")
    print("|---|---|---|---|---|---|---|")
    for n, k in shapes:
        layers = {}
        for spec in ("int8", "int4-g32"):
            layer = ReplicatedLinear(k, n, bias=False, params_dtype=dt)
            layer.weight.data.normal_(0.0, 0.02)
            weight = layer.weight.detach().clone()
            layer.quantize_(parse_quantization(spec), "cpu")
            layers[spec] = layer
        for rows in (1, 4, 8, 12, 16, 24, 32, 64, 96, 128, 256):
            x = torch.randn(rows, k, dtype=dt)
            fns = _sweep_fns(x, weight, layers["int8"], layers["int4-g32"])
            best = _interleaved_best_us(fns)
            print(f"| {n}x{k} | {rows} | " + " | ".join(f"{best[f]:.0f}" for f in fns) + " |",
                  flush=True)


def main() -> None:
    ns = _parse()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.sweep_rows:
        sweep_rows(ns)
        return
    print(f"torch threads: {torch.get_num_threads()}")
    results = run_engines(ns)
    print(format_table(results))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"args": vars(ns), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
