"""Run pagellm and vLLM's CPU build back to back on one workload and print the ratios.

usage: python benchmarks/compare_vllm.py WORKLOAD.jsonl [--dtype bfloat16] [--vllm-python PATH]
       [--hf-dir DIR | --model-config DIR] [--skip-vllm] [--repeats N] [--output-json FILE]
       [--max-model-len N] [--kv-cache-dtype D] [pagellm bench throughput flags...]

``--model-config DIR`` (a folder with only a config.json, e.g. benchmarks/model_configs/*)
measures that model's shapes with random weights on both engines (load_format=dummy, no
tokenizer): the workload's token ids only need to be below its vocabulary size.

The workload is a JSONL of {"prompt_token_ids": [...], "max_tokens": N} (see
../shared/bench/workload.py); every request is generated in full (ignore_eos), greedy, all
submitted at once. vLLM runs in its own venv (default /tmp/venv-vllm, see docs/performance.md)
with the settings that matter on a 2-core machine; its start-up is not timed. pagellm's start-up
is reported separately; prefix caching is off on both unless ``--enable-prefix-caching`` is
given (then on for both). Check that /proc/loadavg is below 0.5 before trusting any figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# vLLM-CPU's settings for this 2-core machine (../shared/PEERS.md): 4 GiB of KV, both cores
# computing, no AOT recompiles, offline.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_USE_AOT_COMPILE": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1"}

VLLM_SNIPPET = r"""
import json, sys, time


def main():
    from vllm import LLM, SamplingParams
    path, dtype, hf_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    dummy, prefix_caching = sys.argv[4] == "1", sys.argv[5] == "1"
    max_model_len, kv_cache_dtype = int(sys.argv[6]), sys.argv[7]
    reqs = [json.loads(line) for line in open(path)]
    extra = {"load_format": "dummy", "skip_tokenizer_init": True} if dummy else {}
    llm = LLM(model=hf_dir, dtype=dtype, max_model_len=max_model_len,
              enable_prefix_caching=prefix_caching, kv_cache_dtype=kv_cache_dtype, **extra)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    print("RESULT " + json.dumps({"elapsed_s": dt, "prompt_tokens": n_in, "output_tokens": n_out}))


if __name__ == "__main__":  # vLLM spawns its engine process
    main()
"""


def run_pagellm(workload: str, dtype: str, extra: list[str], max_model_len: int = 2048,
                kv_cache_dtype: str = "auto") -> dict:
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "throughput", "--dataset",
           workload, "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--kv-cache-memory", "4GiB", "--kv-cache-dtype", kv_cache_dtype, *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_vllm(workload: str, dtype: str, python: str, hf_dir: str, dummy: bool,
             prefix_caching: bool = False, max_model_len: int = 2048,
             kv_cache_dtype: str = "auto") -> dict:
    proc = subprocess.run([python, "-c", VLLM_SNIPPET, workload, dtype, hf_dir,
                           "1" if dummy else "0", "1" if prefix_caching else "0",
                           str(max_model_len), kv_cache_dtype],
                          env={**os.environ, **VLLM_ENV},
                          check=True, capture_output=True, text=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    total = r["prompt_tokens"] + r["output_tokens"]
    r["total_tokens_per_s"] = total / r["elapsed_s"]
    r["output_tokens_per_s"] = r["output_tokens"] / r["elapsed_s"]
    return r


def default_hf_dir() -> str:
    """The default model as an HF folder: pagellm's GGUF conversion cache holds one."""
    from pagellm.models import gguf_cache
    from pagellm.models.loader import resolve_model_source

    src = resolve_model_source(None)
    folder = gguf_cache.cached_folder(src.gguf_path, gguf_cache.WEIGHTS)
    if folder is None:
        raise SystemExit("run pagellm once with the default model first (it writes the HF folder)")
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--vllm-python", default="/tmp/venv-vllm/bin/python")
    ap.add_argument("--hf-dir", default=None,
                    help="the model as an HF folder for vLLM (default: pagellm's conversion of "
                    "the default model); with --model-config, the tokenizer pagellm loads")
    ap.add_argument("--model-config", default=None,
                    help="a folder holding a config.json: that model's shapes, random weights")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=2048, help="both engines")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="both engines (vLLM's names: auto, fp8, fp8_e4m3, fp8_e5m2, ...)")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="N back-to-back pairs, alternating which engine goes first")
    # Any other flag goes to `pagellm bench throughput` (e.g. --max-num-batched-tokens 4096).
    ns, extra = ap.parse_known_args()
    if ns.model_config:
        # The workload's token ids come from the default model's tokenizer; pagellm loads it
        # for detokenizing (vLLM skips its tokenizer instead).
        extra += ["--model", ns.model_config, "--load-format", "dummy",
                  "--tokenizer", ns.hf_dir or default_hf_dir()]
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    print(f"load average at start: {load:.2f}" + ("  (NOT idle: figures unreliable)"
                                                  if load > 0.5 else ""))
    t = time.time()
    result: dict = {"date": time.strftime("%Y-%m-%d", time.localtime(t)), "load_at_start": load,
                    "dtype": ns.dtype, "model_config": ns.model_config,
                    "kv_cache_dtype": ns.kv_cache_dtype, "runs": []}
    for rep in range(ns.repeats):
        # Alternate who goes first, so a drift of the machine's speed favours neither.
        order = ["pagellm", "vllm"] if rep % 2 == 0 or ns.skip_vllm else ["vllm", "pagellm"]
        run: dict = {}
        for engine in order:
            if engine == "pagellm":
                ours = run["pagellm"] = run_pagellm(ns.workload, ns.dtype, extra,
                                                    ns.max_model_len, ns.kv_cache_dtype)
                print(f"pagellm  {ns.dtype}: {ours['elapsed_s']:.1f} s, "
                      f"{ours['total_tokens_per_s']:.0f} total tok/s, "
                      f"{ours['output_tokens_per_s']:.0f} output tok/s "
                      f"(start-up {ours['startup_s']:.1f} s)", flush=True)
            elif not ns.skip_vllm:
                theirs = run["vllm"] = run_vllm(
                    ns.workload, ns.dtype, ns.vllm_python,
                    ns.model_config or ns.hf_dir or default_hf_dir(), bool(ns.model_config),
                    prefix_caching="--enable-prefix-caching" in extra,
                    max_model_len=ns.max_model_len, kv_cache_dtype=ns.kv_cache_dtype)
                print(f"vLLM-CPU {ns.dtype}: {theirs['elapsed_s']:.1f} s, "
                      f"{theirs['total_tokens_per_s']:.0f} total tok/s, "
                      f"{theirs['output_tokens_per_s']:.0f} output tok/s", flush=True)
        if "vllm" in run:
            run["ratio_total_tokens_per_s"] = (run["pagellm"]["total_tokens_per_s"]
                                               / run["vllm"]["total_tokens_per_s"])
            print(f"pagellm / vLLM-CPU total tokens/s: {run['ratio_total_tokens_per_s']:.2f}x",
                  flush=True)
        result["runs"].append(run)
    # The first run's figures at the top level (the single-run layout), the medians with more.
    result.update(result["runs"][0])
    if ns.repeats > 1 and not ns.skip_vllm:
        ratios = sorted(r["ratio_total_tokens_per_s"] for r in result["runs"])
        median = statistics.median(ratios)
        result["median_ratio_total_tokens_per_s"] = median
        print(f"median of {ns.repeats} pairs: {median:.2f}x  (pairs: "
              + ", ".join(f"{r:.2f}" for r in ratios) + ")")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
