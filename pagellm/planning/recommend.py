"""What to change: the nearest settings that fit, and flags sized from observed traffic.

Traffic rules (documented in docs/planning.md, checked by hand in the tests):
- From exact lengths (a log): ``--max-model-len`` = the q-quantile (nearest rank: the smallest
  length at least q of the requests do not exceed) of prompt + output tokens, rounded up to a
  block, capped at the model's context; the rejected share is exact.
- From Prometheus histograms (bucketed, prompt and output counted separately, so the sum's
  distribution is unknown): take each marginal at 1 - (1 - q) / 2, read at the bucket's upper
  bound, and add them. By the union bound, P(prompt + output > a + b) <= P(prompt > a) +
  P(output > b) <= 1 - q, so the recommendation rejects at most 1 - q of the requests; the
  reported share is the best such bound at the recommended length (an upper bound).
- ``--max-num-seqs`` for the memory at hand = KV blocks / mean blocks per request, a request
  counted at its final length (no preemption even if all finish together). From a log: the mean
  of ceil(length / block) over the requests admitted; from histograms: mean length / block + 0.5
  (the exact means come from the _sum series; half a block is the expected rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from pagellm.kv_cache_dtype import parse_kv_cache_dtype
from pagellm.planning.devices import DeviceTarget
from pagellm.planning.model_spec import ModelSpec
from pagellm.planning.planner import TIGHT_CONCURRENCY, PlanSettings, RankPlan, plan_rank
from pagellm.planning.weights import QUANTIZATIONS, valid_tensor_parallel

TP_CHOICES = (2, 4, 8, 16)
# The 8-bit KV dtypes suggested, best quality first (per token-head scales track each row).
KV_DTYPE_SUGGESTIONS = ("int8_per_token_head", "fp8")
HIGH_UTILIZATION = 0.95
MiB = 1 << 20


@dataclass(frozen=True)
class Suggestion:
    flags: str  # what to pass, e.g. "--tensor-parallel-size 4"
    reason: str
    max_model_len: int
    num_blocks: int
    token_capacity: int
    max_concurrency: float
    fits: bool

    def as_dict(self) -> dict[str, object]:
        return dict(asdict(self), max_concurrency=round(self.max_concurrency, 3))


def _suggestion(flags: str, reason: str, plan: RankPlan) -> Suggestion:
    kv = plan.kv
    return Suggestion(flags, reason, kv.max_model_len, kv.num_blocks, kv.token_capacity,
                      kv.max_concurrency, kv.fits)


def _best(candidates: list[tuple[str, str, RankPlan]], than: RankPlan) -> Suggestion | None:
    """The first candidate that fits with room (not tight), else the first that fits at all;
    only candidates that hold more concurrent requests than the current plan count."""
    better = [c for c in candidates if c[2].kv.max_concurrency > than.kv.max_concurrency]
    for wanted in ("fits", "tight"):
        for flags, reason, plan in better:
            if plan.status == wanted:
                return _suggestion(flags, reason, plan)
    return None


def suggest(spec: ModelSpec, device: DeviceTarget, s: PlanSettings,
            plan: RankPlan) -> list[Suggestion]:
    """Nearest settings that fit (or give room, when the plan is tight): a lower
    --max-model-len, more tensor parallelism, an 8-bit --kv-cache-dtype, int8/int4 weights;
    each with its capacity."""
    if plan.status == "fits":
        return []
    out: list[Suggestion | None] = []
    if not plan.kv.fits and plan.kv.num_blocks > 0 and s.num_gpu_blocks_override is None:
        shorter = plan_rank(spec, device, replace(s, max_model_len=plan.kv.token_capacity))
        out.append(_suggestion(f"--max-model-len {plan.kv.token_capacity}",
                               "the longest context the KV cache holds", shorter))
    if device.kind == "cpu" and s.kv_cache_memory is not None:
        # Room for TIGHT_CONCURRENCY requests of max_model_len, in whole MiB.
        need = math.ceil(TIGHT_CONCURRENCY * plan.kv.blocks_per_max_len_request
                         * plan.kv.bytes_per_block / MiB)
        more = plan_rank(spec, device, replace(s, kv_cache_memory=need * MiB))
        out.append(_suggestion(f"--kv-cache-memory {need}MiB",
                               f"room for {TIGHT_CONCURRENCY:g} requests of max_model_len", more))
    if device.kind == "cuda" and s.gpu_memory_utilization < HIGH_UTILIZATION:
        out.append(_best([(f"--gpu-memory-utilization {HIGH_UTILIZATION}",
                           "less headroom for other processes on the GPU",
                           plan_rank(spec, device,
                                     replace(s, gpu_memory_utilization=HIGH_UTILIZATION)))],
                         plan))
    out.append(_best([(f"--tensor-parallel-size {tp}", f"{tp} GPUs share weights and KV heads",
                       plan_rank(spec, device, replace(s, tensor_parallel_size=tp)))
                      for tp in TP_CHOICES
                      # A draft model runs with tensor parallel size 1 only.
                      if tp > s.tensor_parallel_size and valid_tensor_parallel(spec, tp)
                      and s.draft is None], plan))
    if not parse_kv_cache_dtype(s.kv_cache_dtype).quantized:
        # An 8-bit KV cache holds ~2x the tokens of a 16-bit one (int8 adds its scales).
        out.append(_best([(f"--kv-cache-dtype {kv}", "an 8-bit KV cache holds about twice "
                           "the tokens", plan_rank(spec, device, replace(s, kv_cache_dtype=kv)))
                          for kv in KV_DTYPE_SUGGESTIONS], plan))
    quants = QUANTIZATIONS[QUANTIZATIONS.index(s.quantization) + 1:]
    out.append(_best([(f"--quantization {q}", "weight-only quantization frees room for KV",
                       plan_rank(spec, device, replace(s, quantization=q))) for q in quants],
                     plan))
    return [x for x in out if x is not None]


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: (upper bound, cumulative count) ascending, the last +Inf."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float

    def quantile_bound(self, q: float) -> float:
        """The smallest bucket bound with at least q of the observations at or below it."""
        for bound, cum in self.buckets:
            if cum >= q * self.count:
                return bound
        return math.inf

    def share_above(self, t: float) -> float:
        """An upper bound of P(value > t): 1 - cum(largest bucket bound <= t) / count."""
        below = max((cum for bound, cum in self.buckets if bound <= t), default=0.0)
        return 1.0 - below / self.count if self.count else 0.0


@dataclass(frozen=True)
class TrafficAdvice:
    source: str
    num_requests: int
    quantile: float
    quantile_len: int | None  # q-quantile of prompt + output (histograms: the bound a + b;
    # None when it lies in the +Inf bucket)
    max_model_len: int  # recommended
    rejected_share: float  # requests longer than max_model_len (histograms: an upper bound)
    rejected_is_bound: bool
    capped_by_context: bool
    mean_len: float
    mean_blocks: float
    num_blocks: int
    max_num_seqs: int  # recommended for the memory at hand
    fits: bool  # one request of max_model_len fits in the KV cache

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _round_len(length: float, block_size: int, context_len: int) -> tuple[int, bool]:
    rounded = math.ceil(length / block_size) * block_size
    return (context_len, True) if rounded > context_len else (int(rounded), False)


def _seqs(num_blocks: int, mean_blocks: float) -> int:
    return max(1, math.floor(num_blocks / mean_blocks)) if mean_blocks > 0 else 1


def advise_from_lengths(lengths: Sequence[int], quantile: float, block_size: int,
                        context_len: int, num_blocks: int, source: str = "log") -> TrafficAdvice:
    if not lengths:
        raise ValueError(f"{source}: no requests to learn from.")
    ordered = sorted(lengths)
    q_len = ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]
    max_len, capped = _round_len(q_len, block_size, context_len)
    admitted = [n for n in ordered if n <= max_len]
    mean_blocks = (sum(math.ceil(n / block_size) for n in admitted) / len(admitted)
                   if admitted else 0.0)
    return TrafficAdvice(
        source, len(ordered), quantile, q_len, max_len,
        (len(ordered) - len(admitted)) / len(ordered), False, capped,
        sum(ordered) / len(ordered), mean_blocks, num_blocks, _seqs(num_blocks, mean_blocks),
        num_blocks >= math.ceil(max_len / block_size))


def rejected_bound(prompt: Histogram, output: Histogram, max_len: int) -> float:
    """The smallest union bound P(prompt > a) + P(output > max_len - a) over bucket bounds."""
    best = 1.0
    for first, second in ((prompt, output), (output, prompt)):
        for bound, _ in first.buckets:
            if bound <= max_len:
                best = min(best, first.share_above(bound) + second.share_above(max_len - bound))
    return max(0.0, best)


def advise_from_histograms(prompt: Histogram, output: Histogram, quantile: float,
                           block_size: int, context_len: int, num_blocks: int,
                           source: str = "metrics") -> TrafficAdvice:
    if prompt.count <= 0:
        raise ValueError(f"{source}: the histograms hold no finished requests yet.")
    marginal = 1.0 - (1.0 - quantile) / 2
    a, b = prompt.quantile_bound(marginal), output.quantile_bound(marginal)
    q_len = a + b
    max_len, capped = _round_len(min(q_len, float(context_len)), block_size, context_len)
    capped = capped or q_len > context_len
    mean_len = prompt.sum / prompt.count + (output.sum / output.count if output.count else 0.0)
    mean_blocks = mean_len / block_size + 0.5
    return TrafficAdvice(
        source, int(prompt.count), quantile, None if math.isinf(q_len) else int(q_len), max_len,
        rejected_bound(prompt, output, max_len), True, capped, mean_len, mean_blocks,
        num_blocks, _seqs(num_blocks, mean_blocks), num_blocks >= math.ceil(max_len / block_size))
