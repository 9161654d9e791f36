"""Text tables for `pagellm plan`, and the engine's start-up table of planned vs measured."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagellm.planning.weights import num_parameters

if TYPE_CHECKING:
    from pagellm.config import EngineConfig
    from pagellm.memory_plan import KVCachePlan, MemoryBudget
    from pagellm.planning.planner import PlanReport, RankPlan
    from pagellm.planning.recommend import TrafficAdvice

logger = logging.getLogger("pagellm")


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], text_last: bool = False) -> str:
    """First column left-aligned, numbers right-aligned (a text last column left-aligned)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i == 0 or (text_last and i == len(row) - 1) else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _memory_rows(budgets: Sequence[MemoryBudget], kvs: Sequence[KVCachePlan]) -> list[list[str]]:
    b0, kv0 = budgets[0], kvs[0]
    rows = [["device memory" + (" (available)" if b0.device_type == "cpu" else ""),
             *(fmt_bytes(b.total_bytes) for b in budgets)]]
    if b0.gpu_memory_utilization is not None:
        rows.append([f"usable (x {b0.gpu_memory_utilization:.2f})",
                     *(fmt_bytes(int(b.total_bytes * (b.gpu_memory_utilization or 0)))
                       for b in budgets)])
    rows += [
        ["weights", *(fmt_bytes(b.weight_bytes) for b in budgets)],
        ["peak activations", *(fmt_bytes(b.activation_bytes) for b in budgets)],
        ["non-torch overhead", *(fmt_bytes(b.non_torch_bytes) for b in budgets)],
        ["KV budget" + (" (--kv-cache-memory or free RAM)" if b0.device_type == "cpu" else ""),
         *(fmt_bytes(k.kv_budget_bytes) for k in kvs)],
        ["KV bytes per token", *(f"{k.kv_bytes_per_token:,}" for k in kvs)],
        [f"blocks of {kv0.block_size} tokens", *(f"{k.num_blocks:,}" for k in kvs)],
        ["token capacity", *(f"{k.token_capacity:,}" for k in kvs)],
        [f"max concurrency @ {kv0.max_model_len}", *(f"{k.max_concurrency:.2f}x" for k in kvs)],
    ]
    return rows


def format_report(report: PlanReport) -> str:
    spec, s, dev = report.spec, report.settings, report.device
    r0 = report.ranks[0]
    params = num_parameters(spec) / 1e9
    stored = f", {fmt_bytes(spec.checkpoint_bytes)} stored" if spec.checkpoint_bytes else ""
    tp = s.tensor_parallel_size
    lines = [
        f"pagellm plan: {spec.name} ({spec.architecture}, {params:.2f}B parameters, "
        f"{spec.checkpoint_format}{stored})",
        f"target: {dev.name} ({dev.description}) x {tp}, dtype {s.dtype}, "
        f"quantization {s.quantization}, KV cache dtype {s.kv_cache_dtype}",
        f"flags: --max-model-len {s.max_model_len} --max-num-seqs {s.max_num_seqs} "
        f"--max-num-batched-tokens {s.max_num_batched_tokens} --block-size {s.block_size}"
        + (f" --gpu-memory-utilization {s.gpu_memory_utilization}" if dev.kind == "cuda"
           else ""),
        "",
    ]
    header = ["", f"rank 0 (each of {tp})" if tp > 1 else "rank 0"]
    rows = _memory_rows([r0.budget], [r0.kv])
    w = r0.weights
    at = next(i for i, row in enumerate(rows) if row[0] == "weights") + 1
    rows[at:at] = [["  embedding + LM head", fmt_bytes(w.embedding + w.lm_head)],
                   ["  attention", fmt_bytes(w.attention)], ["  MLP", fmt_bytes(w.mlp)],
                   ["  norms", fmt_bytes(w.norms)]]
    if r0.draft_weight_bytes:
        rows.insert(at + 4, ["  draft model (speculative decoding)",
                             fmt_bytes(r0.draft_weight_bytes)])
        at = next(i for i, row in enumerate(rows) if row[0] == "KV bytes per token") + 1
        rows.insert(at, ["  of which the draft model", f"{r0.draft_kv_bytes_per_token:,}"])
    if r0.window_saving > 0:
        rows.append([f"KV of one {s.max_model_len}-token request",
                     fmt_bytes(r0.request_kv_bytes)])
        rows.append([f"  if no layer slid (saving {100 * r0.window_saving:.1f}%)",
                     fmt_bytes(r0.request_kv_bytes_full)])
    if r0.state_slot_bytes:
        rows.append([f"recurrent state ({len(spec.recurrent_layers)} layers)",
                     f"{fmt_bytes(r0.state_slot_bytes)} per sequence, "
                     f"{fmt_bytes(r0.state_bytes)} for {s.max_num_seqs} (+1 scratch)"])
        if r0.snapshot_slots:
            snap_bytes = fmt_bytes(r0.snapshot_slots * r0.state_slot_bytes)
            rows.append(["  prefix-cache snapshots",
                         f"{r0.snapshot_slots:,} ({snap_bytes}), one every "
                         f"{r0.snapshot_interval_tokens:,} tokens"])
    rows.append(["status", r0.status])
    lines.append(_table(header, rows))
    if not r0.kv.fits:
        lines += ["", f"does not fit: one request of {s.max_model_len} tokens needs "
                      f"{r0.kv.blocks_per_max_len_request:,} blocks; the KV cache holds "
                      f"{r0.kv.num_blocks:,}."]
    if report.suggestions:
        lines += ["", "nearest settings that " + ("fit:" if not r0.kv.fits else "give room:")]
        lines.append(_table(["  flags", "capacity", "concurrency", "why"], [
            [f"  {x.flags}", f"{x.token_capacity:,} tok",
             f"{x.max_concurrency:.2f}x @ {x.max_model_len}", x.reason]
            for x in report.suggestions], text_last=True))
    if report.traffic is not None:
        lines += ["", *format_traffic(report.traffic)]
    lines += [f"note: {w}" for w in report.warnings]
    return "\n".join(lines)


def format_traffic(t: TrafficAdvice) -> list[str]:
    pct = f"{100 * t.quantile:g}"
    observed = f"{t.quantile_len:,}" if t.quantile_len is not None else "beyond the last bucket"
    how = "bucket bounds, prompt + output" if t.rejected_is_bound else "prompt + output"
    share = f"{'at most ' if t.rejected_is_bound else ''}{100 * t.rejected_share:.2f}%"
    lines = [
        f"from traffic ({t.source}, {t.num_requests:,} requests):",
        f"  --max-model-len {t.max_model_len}: p{pct} ({how}) = {observed} tokens, rounded up "
        f"to a block{', capped at the model context' if t.capped_by_context else ''}; "
        f"it would reject {share} of these requests",
        f"  --max-num-seqs {t.max_num_seqs}: {t.num_blocks:,} KV blocks / {t.mean_blocks:.2f} "
        f"blocks per request (mean length {t.mean_len:.1f} tokens)",
    ]
    if not t.fits:
        lines.append(f"  (the KV cache holds {t.num_blocks:,} blocks: less than one request of "
                     f"{t.max_model_len} tokens; see the settings above)")
    return lines


def format_planned_vs_measured(planned: RankPlan, measured: MemoryBudget,
                               measured_kv: KVCachePlan) -> str:
    rows = _memory_rows([planned.budget, measured], [planned.kv, measured_kv])
    return _table(["memory plan", "planned", "measured"], rows)


def log_planned_vs_measured(config: EngineConfig, measured: MemoryBudget,
                            measured_kv: KVCachePlan) -> None:
    """Log `pagellm plan`'s table for this engine with the measured numbers beside it."""
    from pagellm.planning.planner import planned_for_engine

    try:
        planned = planned_for_engine(config, measured)
    except (ValueError, AttributeError, TypeError) as e:
        # A config the estimator cannot read must not stop an engine that loaded fine.
        logger.warning("memory plan unavailable for this model: %s", e)
        return
    logger.info("memory plan (pagellm plan) vs measured:\n%s",
                format_planned_vs_measured(planned, measured, measured_kv))
