"""``--kv-cache-dtype`` quality on the default model (or ``--model``): greedy output of each KV
dtype against the unquantized cache (``auto``) on the same held-out prompts, one engine at a
time. Prints, per dtype, the identical sequences, the mean common prefix (tokens) and the KV
bytes per token / token capacity the engine allocated; ``--time`` adds the wall time of each
run (run it on an idle machine; the ratio to ``auto`` is what to read).

    .venv/bin/python benchmarks/kv_cache_dtype.py --dtype bfloat16 --num-prompts 16
    .venv/bin/python benchmarks/kv_cache_dtype.py --prompt-len 3000 --max-tokens 64 --time
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pagellm import LLM, SamplingParams

DTYPES = ("auto", "int8_per_token_head", "fp8", "fp8_e5m2")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(kv: str, args: argparse.Namespace, prompts: list[dict]) -> dict:
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=kv,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    plan = llm.llm_engine.engine_core.executor.runner.kv_plan
    result = {"kv_cache_dtype": kv, "tokens": [o.outputs[0].token_ids for o in outs],
              "kv_bytes_per_token": plan.kv_bytes_per_token,
              "token_capacity": plan.token_capacity, "seconds": seconds}
    llm.llm_engine.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtypes", default=",".join(DTYPES))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time", action="store_true", help="print the wall time of each run")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    # Token ids from the middle of the vocabulary: held out from any tuning, the same for all.
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]}
               for _ in range(args.num_prompts)]
    kinds = args.kv_cache_dtypes.split(",")
    results = [run(kv, args, prompts) for kv in ("auto", *[k for k in kinds if k != "auto"])]
    base = results[0]
    print(f"{'kv dtype':<22}{'identical':>10}{'mean prefix':>13}{'bytes/tok':>11}"
          f"{'capacity':>10}" + (f"{'seconds':>9}{'ratio':>7}" if args.time else ""))
    for r in results:
        prefixes = [common_prefix(a, b) for a, b in zip(base["tokens"], r["tokens"], strict=True)]
        same = sum(a == b for a, b in zip(base["tokens"], r["tokens"], strict=True))
        r.update(identical=same, mean_common_prefix=sum(prefixes) / len(prefixes))
        line = (f"{r['kv_cache_dtype']:<22}{same:>5}/{len(prompts):<4}"
                f"{r['mean_common_prefix']:>13.1f}{r['kv_bytes_per_token']:>11}"
                f"{r['token_capacity']:>10}")
        if args.time:
            line += f"{r['seconds']:>9.2f}{r['seconds'] / base['seconds']:>7.2f}"
        print(line)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in results], f,
                      indent=2)


if __name__ == "__main__":
    main()
