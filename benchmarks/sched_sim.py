"""Scheduler policies under online load, simulated: the real Scheduler, a step-time model.

usage: python benchmarks/sched_sim.py --rates 2,4,8,12 [--seeds 5] [--num-prompts 200]
       [--cost "t0=...,tok=...,kv=...,attn=..."] --policy NAME='{"max_num_seqs": 128}' ...

On a shared 2-core machine, end-to-end timings of two policies differ by more than the policies
do. Here the scheduler (pagellm.core.scheduler, unchanged) runs against a model of the step
time fitted to measured steps (``compare_vllm_steps.py --shapes``): a step of ``tokens`` tokens
whose decodes read ``kv`` cached tokens and whose prefill chunks attend over ``attn``
query x key pairs takes ``t0 + tok * tokens + kv * kv_tokens + attn * attn_pairs`` seconds, plus
``big * tokens`` in steps of more than ``big_at`` tokens (on the AMX machine such steps leave the
fused path: 0.51-0.60 ms per prompt token against 0.42-0.45).
Arrivals are Poisson (prompts 128-384 tokens, outputs 64-192, as compare_vllm_steps.py and the
issue's online runs); every request generates its full output. Per rate and policy it prints
medians over the seeds of TTFT and TPOT percentiles, e2e p50, output tokens/s, and whether the
rate is sustained by ``pagellm bench serve``'s rule (p99 TTFT <= 2 s, p99 TPOT <= 200 ms, TTFT
not growing: the median of the last third of arrivals at most 2x, or 100 ms above, the first
third's). A policy's ``max_num_queued_tokens`` is the server's --max-num-queued-tokens: an
arrival is refused (a 503, counted) while the prompts without a first token hold that many
tokens; the latencies are then those of the admitted requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagellm.core.sched_output import ModelRunnerOutput  # noqa: E402
from pagellm.core.scheduler import Scheduler  # noqa: E402
from pagellm.request import Request  # noqa: E402
from pagellm.sampling_params import SamplingParams  # noqa: E402

DEFAULT_POLICY = {"max_num_seqs": 256, "max_num_batched_tokens": 2048,
                  "long_prefill_token_threshold": 0}


@dataclass(frozen=True)
class StepCost:
    t0: float  # seconds per step
    tok: float  # per scheduled token (the linear layers)
    kv: float  # per cached token a decode reads
    attn: float  # per query x key pair of a prefill chunk
    big: float = 0.0  # extra per token in steps of more than big_at tokens
    big_at: float = float("inf")

    @classmethod
    def parse(cls, text: str) -> StepCost:
        fields = dict(part.split("=") for part in text.split(",") if part)
        return cls(**{k: float(v) for k, v in fields.items()})

    def step_time(self, sched: Scheduler, num_scheduled: dict[str, int]) -> float:
        tokens = kv_tokens = attn_pairs = 0
        for rid, n in num_scheduled.items():
            end = sched.requests[rid].num_computed_tokens  # advanced at schedule time
            tokens += n
            if n == 1:
                kv_tokens += end
            else:
                attn_pairs += n * (end - n / 2)
        per_token = self.tok + (self.big if tokens > self.big_at else 0.0)
        return self.t0 + per_token * tokens + self.kv * kv_tokens + self.attn * attn_pairs


def run(policy: dict, cost: StepCost, rate: float, num: int, seed: int,
        kv_blocks: int) -> dict:
    cfg = {**DEFAULT_POLICY, **policy}
    queued_cap = cfg.pop("max_num_queued_tokens", None)
    sched = Scheduler(SimpleNamespace(max_model_len=2048, **cfg),
                      SimpleNamespace(block_size=16, enable_prefix_caching=False,
                                      prefix_caching_hash_algo="sha256"), kv_blocks)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, num))
    lens_in, lens_out = rng.integers(128, 385, num), rng.integers(64, 193, num)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    prefilling: dict[str, int] = {}  # admitted, no first token yet: prompt tokens
    refused: set[int] = set()
    now, added = 0.0, 0
    while len(last) + len(refused) < num:
        while added < num and arrivals[added] <= now:
            if queued_cap is not None and sum(prefilling.values()) >= queued_cap:
                refused.add(added)
                added += 1
                continue
            sp = SamplingParams(max_tokens=int(lens_out[added]), ignore_eos=True)
            sched.add_request(Request(f"r{added}", list(range(1, int(lens_in[added]) + 1)), sp,
                                      eos_token_id=None, max_tokens=int(lens_out[added])))
            prefilling[f"r{added}"] = int(lens_in[added])
            added += 1
        if not sched.has_unfinished_requests():
            if added < num:
                now = max(now, float(arrivals[added]))
            continue
        out = sched.schedule()
        now += cost.step_time(sched, out.num_scheduled_tokens)
        ids = list(out.num_scheduled_tokens)
        sampled = [[1] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                   else [] for r in ids]
        for o in sched.update_from_output(out, ModelRunnerOutput(req_ids=ids,
                                                                 sampled_token_ids=sampled)):
            first.setdefault(o.req_id, now)
            prefilling.pop(o.req_id, None)
            if o.finish_reason is not None:
                last[o.req_id] = now
    done = [i for i in range(num) if i not in refused]
    ttft = [first[f"r{i}"] - arrivals[i] for i in done]
    tpot = [(last[f"r{i}"] - first[f"r{i}"]) / max(1, int(lens_out[i]) - 1) for i in done]
    e2e = [last[f"r{i}"] - arrivals[i] for i in done]
    third = len(done) // 3
    early, late = statistics.median(ttft[:third]), statistics.median(ttft[-third:])
    p99_ttft, p99_tpot = float(np.percentile(ttft, 99)), float(np.percentile(tpot, 99))
    sustained = (p99_ttft <= 2.0 and p99_tpot <= 0.2
                 and (late <= 2 * early or late <= early + 0.1))
    return {"ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": p99_ttft,
            "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p99": p99_tpot,
            "e2e_p50": float(np.percentile(e2e, 50)),
            "out_tok_s": float(sum(lens_out[i] for i in done)) / max(last.values()),
            "refused": len(refused) / num, "sustained": sustained}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="2,4,8,12")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--kv-blocks", type=int, default=16384, help="16-token blocks")
    ap.add_argument("--cost", required=True, help="t0=S,tok=S,kv=S,attn=S (seconds)")
    ap.add_argument("--policy", action="append", default=[],
                    help="NAME=JSON of scheduler settings (repeatable); 'default' is added")
    ns = ap.parse_args(argv)
    cost = StepCost.parse(ns.cost)
    policies = {"default": {}}
    for item in ns.policy:
        name, _, text = item.partition("=")
        policies[name] = json.loads(text)
    print(f"cost model: {cost}")
    print(f"{'rate':>5} {'policy':24} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} "
          f"{'e2e p50':>8} {'out tok/s':>9} {'503s':>5} sustained (of {ns.seeds} seeds)")
    for rate in (float(r) for r in ns.rates.split(",")):
        for name, policy in policies.items():
            runs = [run(policy, cost, rate, ns.num_prompts, seed, ns.kv_blocks)
                    for seed in range(ns.seeds)]

            def med(key: str, runs: list[dict] = runs) -> float:
                return statistics.median(r[key] for r in runs)

            print(f"{rate:5g} {name:24} {med('ttft_p50'):9.2f} {med('ttft_p99'):7.2f} "
                  f"{1000 * med('tpot_p50'):7.0f}ms {1000 * med('tpot_p99'):5.0f}ms "
                  f"{med('e2e_p50'):8.1f} {med('out_tok_s'):9.0f} {med('refused'):5.0%} "
                  f"{sum(r['sustained'] for r in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
