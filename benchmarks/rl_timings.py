"""Timings of an RL loop's engine-side costs: weight push, sleep/wake, rollout throughput.

    .venv/bin/python benchmarks/rl_timings.py                       # default model, fp32 + bf16
    .venv/bin/python benchmarks/rl_timings.py --dtypes bfloat16 --repeats 3 --output-json t.json

For each dtype, in one process:
- ``load_weights``: ``llm.load_weights(hf_model.named_parameters())`` with every tensor of the
  model (transformers, same dtype), median of ``--repeats``.
- sleep/wake: ``sleep(level=1)`` + ``wake_up()`` and ``sleep(level=2)`` + ``wake_up()`` (level 2
  reloads the weights from the checkpoint), median of ``--repeats``; the resident size (VmRSS)
  freed by the first sleep of each level, which follows a full rollout batch (KV pages in use).
- rollouts: the same groups (``--prompts`` chat prompts x ``--group-size`` samples,
  ``--new-tokens`` tokens each, temperature 1, no top-k/top-p, EOS ignored so both make exactly
  the same number of tokens) by pagellm (``SamplingParams(n=group)``) and by
  ``transformers.generate`` (left-padded batch, ``num_return_sequences=group``); generated
  tokens/s of each (prefill included), median of ``--gen-repeats``, and the ratio.
The load average is printed beside the table: on a shared machine the figures are noisy.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagellm import LLM, SamplingParams

QUESTIONS = [
    "What is 7 + 5?", "Name three primary colors.", "Write a haiku about the sea.",
    "Why is the sky blue?", "Give me a tip for learning Python.", "What is a prime number?",
    "Describe a cat in one sentence.", "How do airplanes fly?", "What is 12 times 3?",
    "Suggest a name for a dog.", "What is the capital of France?", "Explain recursion briefly.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None,
                    help="HF folder (default: SmolLM2-135M-Instruct, from pagellm's GGUF cache)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    ap.add_argument("--repeats", type=int, default=5, help="load_weights and sleep/wake rounds")
    ap.add_argument("--gen-repeats", type=int, default=3, help="timed rollout batches per engine")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if args.prompts > len(QUESTIONS):
        ap.error(f"--prompts: at most {len(QUESTIONS)}")
    return args


def default_hf_dir() -> str:
    """The default model as an HF folder: examples/grpo.py's (the GGUF conversion cache)."""
    path = Path(__file__).resolve().parent.parent / "examples" / "grpo.py"
    spec = importlib.util.spec_from_file_location("pagellm_grpo_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.default_hf_dir()


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def trim_heap() -> None:
    """Give freed heap pages back first, so the RSS drop measured is the sleep's own."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def sleep_round(llm: LLM, level: int) -> tuple[float, float, int]:
    """(sleep ms, wake_up ms, bytes of RSS the sleep freed)."""
    trim_heap()
    before = rss_bytes()
    t0 = time.perf_counter()
    llm.sleep(level=level)
    t1 = time.perf_counter()
    freed = before - rss_bytes()
    llm.wake_up()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, freed


def sleep_timings(llm: LLM, level: int, repeats: int, rollout: Callable[[], Any]) -> dict:
    rollout()  # the first sleep follows a full batch: its KV pages are resident
    rounds = [sleep_round(llm, level) for _ in range(repeats)]
    return {f"sleep{level}_ms": statistics.median(r[0] for r in rounds),
            f"wake{level}_ms": statistics.median(r[1] for r in rounds),
            f"sleep{level}_rss_freed_mib": rounds[0][2] / 2**20}


def chat_prompts(tok: Any, n: int) -> list[list[int]]:
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                         add_generation_prompt=True, return_dict=False))
            for q in QUESTIONS[:n]]


def pagellm_rollout(llm: LLM, prompts: list[list[int]], args: argparse.Namespace) -> int:
    params = SamplingParams(n=args.group_size, temperature=1.0, top_p=1.0, top_k=0,
                            max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


def hf_rollout(model: Any, pad_id: int, prompts: list[list[int]],
               args: argparse.Namespace) -> int:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0,
                             num_return_sequences=args.group_size,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             pad_token_id=pad_id)
    return (out.shape[1] - width) * out.shape[0]


def tokens_per_s(fn: Callable[[], int], repeats: int) -> float:
    fn()  # warm-up: first-call allocations, thread pools
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def measure_dtype(model_dir: str, dtype: str, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    llm = LLM(model=model_dir, dtype=dtype, seed=args.seed, enable_sleep_mode=True,
              kv_cache_memory=args.kv_cache_memory, max_model_len=512)
    prompts = chat_prompts(tok, args.prompts)
    res: dict[str, Any] = {"load_avg_start": loadavg()}

    params = dict(hf.named_parameters())
    res["weights_mib"] = sum(p.numel() * p.element_size() for p in params.values()) / 2**20
    with torch.no_grad():
        llm.load_weights(params.items())  # warm-up
        res["load_weights_ms"] = median_ms(lambda: llm.load_weights(params.items()),
                                           args.repeats)

    torch.manual_seed(args.seed)
    res["pagellm_tok_s"] = tokens_per_s(lambda: pagellm_rollout(llm, prompts, args),
                                        args.gen_repeats)
    res["hf_tok_s"] = tokens_per_s(lambda: hf_rollout(hf, pad_id, prompts, args),
                                   args.gen_repeats)
    res["ratio"] = res["pagellm_tok_s"] / res["hf_tok_s"]

    for level in (1, 2):
        res |= sleep_timings(llm, level, args.repeats,
                             lambda: pagellm_rollout(llm, prompts, args))
    res["load_avg_end"] = loadavg()
    return res  # the engine and the HF model go with this frame


ROWS = [
    ("weights_mib", "weights pushed (MiB)", "{:.0f}"),
    ("load_weights_ms", "load_weights, whole model (ms)", "{:.0f}"),
    ("sleep1_ms", "sleep(level=1) (ms)", "{:.1f}"),
    ("wake1_ms", "wake_up after level 1 (ms)", "{:.1f}"),
    ("sleep1_rss_freed_mib", "RSS freed by level 1 (MiB)", "{:.0f}"),
    ("sleep2_ms", "sleep(level=2) (ms)", "{:.1f}"),
    ("wake2_ms", "wake_up after level 2 (ms)", "{:.0f}"),
    ("sleep2_rss_freed_mib", "RSS freed by level 2 (MiB)", "{:.0f}"),
    ("pagellm_tok_s", "rollout tokens/s, pagellm", "{:.1f}"),
    ("hf_tok_s", "rollout tokens/s, transformers.generate", "{:.1f}"),
    ("ratio", "pagellm / transformers", "{:.2f}x"),
    ("load_avg_start", "load average at start", "{}"),
    ("load_avg_end", "load average at end", "{}"),
]


def print_table(results: dict[str, dict], args: argparse.Namespace) -> None:
    dtypes = list(results)
    print(f"\nrollouts: {args.prompts} prompts x {args.group_size} samples x {args.new_tokens} "
          f"new tokens, temperature 1; torch threads {torch.get_num_threads()}")
    width = max(len(label) for _, label, _ in ROWS)
    print(f"| {'':{width}} | " + " | ".join(f"{d:>17}" for d in dtypes) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * 19 for _ in dtypes) + "|")
    for key, label, fmt in ROWS:
        cells = [fmt.format(results[d][key]) for d in dtypes]
        print(f"| {label:{width}} | " + " | ".join(f"{c:>17}" for c in cells) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model or default_hf_dir()
    results = {}
    for dtype in args.dtypes.split(","):
        results[dtype] = measure_dtype(model_dir, dtype, args)
        print(f"{dtype}: {json.dumps(results[dtype])}", flush=True)  # partial results early
        gc.collect()  # free the previous dtype's engine and model before the next
    print_table(results, args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
