"""Multi-turn agent workload on a hybrid (linear attention) model: prefix-cache hit rate and time,
pagellm with caching off and on, and vLLM's CPU build (caching on) where it serves the model.

usage: python benchmarks/hybrid_prefix_cache.py [--model-config DIR] [--conversations 8]
       [--turns 6] [--first 1000] [--message 200-400] [--answer 64] [--skip-vllm] [--skip-pagellm]
       [--vllm-python /tmp/venv-vllm/bin/python] [--output-json FILE]

Each conversation's turn resends its whole history (first message, every answer so far, every
message) plus a new message; turn k of every conversation is submitted at once (a batch of
agents), greedy, answers generated in full. Weights are random (``--load-format dummy``), so
each engine answers differently: each resends its own answers, and the hit rate compares how
much of what it resends each engine's cache serves. Hit rate = cached prompt tokens / prompt
tokens over turns 2.. (turn 1 has nothing to hit). Check /proc/loadavg < 0.5 first.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "model_configs", "qwen3.5-35b-a3b-4layers")

# The loop both engines run (pagellm in-process, vLLM in its venv): the same code, one engine.
LOOP = r"""
def run_turns(generate, messages, answer_len):
    history = [[] for _ in messages]
    prompt_tokens = cached_tokens = later_prompt = later_cached = 0
    start = time.perf_counter()
    for turn in range(len(messages[0])):
        prompts = [h + m[turn] for h, m in zip(history, messages)]
        outs = generate(prompts, answer_len)
        for i, (p, (answer, cached)) in enumerate(zip(prompts, outs)):
            history[i] = p + answer
            prompt_tokens += len(p)
            cached_tokens += cached
            if turn:
                later_prompt += len(p)
                later_cached += cached
    return {"seconds": time.perf_counter() - start, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "hit_rate_after_first_turn": later_cached / max(later_prompt, 1)}
"""

VLLM_SNIPPET = r"""
import json, sys, time
""" + LOOP + r"""

def main():
    from vllm import LLM, SamplingParams
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=spec["max_model_len"],
              enable_prefix_caching=True, load_format="dummy", skip_tokenizer_init=True)

    def generate(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]

    print("RESULT " + json.dumps(run_turns(generate, spec["messages"], spec["answer"])))


main()
"""

VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
            "VLLM_USE_AOT_COMPILE": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1"}


def make_messages(n: int, turns: int, first: int, lo: int, hi: int, vocab: int,
                  seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[[rng.randrange(10, vocab) for _ in range(first if t == 0 else rng.randint(lo, hi))]
             for t in range(turns)] for _ in range(n)]


def run_pagellm(model: str, tokenizer: str, messages, answer: int, caching: bool,
                max_model_len: int) -> dict:
    from pagellm import LLM, SamplingParams

    namespace: dict = {"time": time}
    exec(LOOP, namespace)  # noqa: S102 (the loop shared with the vLLM side)
    llm = LLM(model=model, tokenizer=tokenizer, load_format="dummy", dtype="bfloat16",
              max_model_len=max_model_len, enable_prefix_caching=caching,
              kv_cache_memory="4GiB")

    def generate(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]

    result = namespace["run_turns"](generate, messages, answer)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    if kv.snapshots is not None:
        result["snapshot_slots"] = kv.snapshots.num_slots
        result["snapshot_interval_tokens"] = kv.snapshots.interval_blocks * kv.block_size
        result["snapshots_evicted"] = kv.snapshots.num_evicted
    llm.llm_engine.shutdown()
    return result


def run_vllm(python: str, model: str, messages, answer: int, max_model_len: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": model, "messages": messages, "answer": answer,
                   "max_model_len": max_model_len}, f)
    proc = subprocess.run([python, "-c", VLLM_SNIPPET, f.name], capture_output=True, text=True,
                          env={**os.environ, **VLLM_ENV}, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    return {"error": "vLLM did not finish", "log_tail": tail}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default=DEFAULT_CONFIG)
    ap.add_argument("--tokenizer", default=None, help="default: the default model's HF folder")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first", type=int, default=1000, help="tokens of each first message")
    ap.add_argument("--message", default="200-400", help="tokens of each later message")
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-pagellm", action="store_true")
    ap.add_argument("--vllm-python", default="/tmp/venv-vllm/bin/python")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    lo, hi = (int(x) for x in ns.message.split("-"))
    config = json.load(open(os.path.join(ns.model_config, "config.json")))
    vocab = min(int(config["vocab_size"]), 49152)  # ids the default tokenizer can detokenize
    messages = make_messages(ns.conversations, ns.turns, ns.first, lo, hi, vocab, ns.seed)
    longest = ns.first + (ns.turns - 1) * hi + ns.turns * ns.answer
    max_model_len = -(-longest // 1024) * 1024
    if ns.tokenizer is None:
        sys.path.insert(0, HERE)
        from compare_vllm import default_hf_dir

        ns.tokenizer = default_hf_dir()
    results = {"workload": {"conversations": ns.conversations, "turns": ns.turns,
                            "first": ns.first, "message": ns.message, "answer": ns.answer,
                            "model_config": ns.model_config, "max_model_len": max_model_len}}
    # vLLM first: its subprocess needs the memory the pagellm engines of this process hold
    # (two copies of a model's weights do not fit beside each other on a 24 GiB machine).
    if not ns.skip_vllm:
        results["vllm-cpu caching on"] = run_vllm(ns.vllm_python, ns.model_config, messages,
                                                  ns.answer, max_model_len)
        print("vllm-cpu caching on", json.dumps(results["vllm-cpu caching on"]), flush=True)
    for caching in (() if ns.skip_pagellm else (False, True)):
        name = f"pagellm caching {'on' if caching else 'off'}"
        results[name] = run_pagellm(ns.model_config, ns.tokenizer, messages, ns.answer,
                                    caching, max_model_len)
        print(name, json.dumps(results[name]), flush=True)
        gc.collect()
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
