"""The plan itself: model spec + target device + engine flags -> one RankPlan per rank.

The KV arithmetic is the engine's own (pagellm.memory_plan): the same MemoryBudget and
plan_kv_cache, fed with estimates here and with measured numbers at engine start-up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pagellm.core.kv_cache_groups import KVCacheLayout, kv_cache_layout
from pagellm.kv_cache_dtype import parse_kv_cache_dtype
from pagellm.memory_plan import (
    STATE_SNAPSHOT_SHARE,
    KVCachePlan,
    MemoryBudget,
    cpu_memory_budget,
    cuda_memory_budget,
    kv_bytes_per_token,
    plan_kv_cache,
    state_snapshot_plan,
)
from pagellm.planning.devices import (
    DeviceTarget,
    estimate_activation_bytes,
    estimate_overhead_bytes,
    parse_device,
)
from pagellm.planning.model_spec import ModelSpec, load_model_spec
from pagellm.planning.weights import WeightBreakdown, num_parameters, weight_bytes_per_rank
from pagellm.spec_decode.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from pagellm.config import EngineConfig
from pagellm.engine_args import EngineArgs

# Fewer max-model-len requests than this at once is "tight": still fits, but worth a look.
TIGHT_CONCURRENCY = 4.0
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PlanSettings:
    """The engine flags that shape memory, resolved (no "auto" left)."""

    dtype: str  # "float32", "bfloat16" or "float16"
    quantization: str
    tensor_parallel_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory: int | None
    num_gpu_blocks_override: int | None = None
    # A draft model (--speculative-config method draft_model; tensor parallel size 1 only),
    # whose weights and cache share the budget as in the engine (worker/kv_cache.py).
    draft: ModelSpec | None = None
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype (pagellm/kv_cache_dtype.py)
    # Hybrid models keep state snapshots for prefix caching (core/state_snapshots.py).
    enable_prefix_caching: bool = False

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def kv_value_bytes(self) -> int:
        """Bytes of one stored K/V value at --kv-cache-dtype."""
        return parse_kv_cache_dtype(self.kv_cache_dtype).element_bytes(self.dtype_bytes)

    @property
    def kv_scale_bytes(self) -> int:
        return parse_kv_cache_dtype(self.kv_cache_dtype).scale_bytes()


@dataclass(frozen=True)
class RankPlan:
    rank: int
    weights: WeightBreakdown
    budget: MemoryBudget
    kv: KVCachePlan
    # KV bytes one max_model_len request holds at its peak, and what it would hold if every
    # layer attended to the whole context (they differ for sliding-window models).
    request_kv_bytes: int = 0
    request_kv_bytes_full: int = 0
    # A draft model (--speculative-config method draft_model): its weights and its cache's
    # bytes per token, both inside the totals above (its blocks share the target's ids).
    draft_weight_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    # Hybrid models: one state slot's bytes (every recurrent layer), the running sequences'
    # slots' bytes (max_num_seqs + a scratch slot), and with prefix caching the snapshot
    # slots and the tokens between two snapshots; all from the KV budget.
    state_slot_bytes: int = 0
    state_bytes: int = 0
    snapshot_slots: int = 0
    snapshot_interval_tokens: int = 0

    @property
    def window_saving(self) -> float:
        """The share of a max_model_len request's KV that sliding windows save (0: none)."""
        if not self.request_kv_bytes_full:
            return 0.0
        return 1.0 - self.request_kv_bytes / self.request_kv_bytes_full

    @property
    def status(self) -> str:
        if not self.kv.fits:
            return "does not fit"
        return "tight" if self.kv.max_concurrency < TIGHT_CONCURRENCY else "fits"

    def as_dict(self) -> dict[str, Any]:
        b = self.budget
        return {
            "rank": self.rank, "weight_bytes": self.weights.total,
            "weight_breakdown": self.weights.as_dict(), "activation_bytes": b.activation_bytes,
            "overhead_bytes": b.non_torch_bytes, "total_bytes": b.total_bytes,
            "gpu_memory_utilization": b.gpu_memory_utilization,
            "kv_bytes_per_token": self.kv.kv_bytes_per_token,
            "kv_budget_bytes": self.kv.kv_budget_bytes, "block_size": self.kv.block_size,
            "num_blocks": self.kv.num_blocks, "token_capacity": self.kv.token_capacity,
            "max_model_len": self.kv.max_model_len,
            "max_concurrency": round(self.kv.max_concurrency, 3), "fits": self.kv.fits,
            "status": self.status, "request_kv_bytes": self.request_kv_bytes,
            "request_kv_bytes_full_attention": self.request_kv_bytes_full,
            "sliding_window_saving": round(self.window_saving, 4),
            "draft_weight_bytes": self.draft_weight_bytes,
            "draft_kv_bytes_per_token": self.draft_kv_bytes_per_token,
            "state_slot_bytes": self.state_slot_bytes, "state_bytes": self.state_bytes,
            "state_snapshot_slots": self.snapshot_slots,
            "state_snapshot_interval_tokens": self.snapshot_interval_tokens,
        }


@dataclass
class PlanReport:
    spec: ModelSpec
    device: DeviceTarget
    settings: PlanSettings
    ranks: list[RankPlan]
    warnings: list[str] = field(default_factory=list)
    suggestions: list[Any] = field(default_factory=list)  # recommend.Suggestion
    traffic: Any = None  # recommend.TrafficAdvice

    @property
    def fits(self) -> bool:
        return all(r.kv.fits for r in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": dict(self.spec.as_dict(), num_parameters=num_parameters(self.spec)),
            "device": self.device.as_dict(),
            "settings": dict(asdict(self.settings), draft=None if self.settings.draft is None
                             else self.settings.draft.as_dict()),
            "ranks": [r.as_dict() for r in self.ranks], "fits": self.fits,
            "suggestions": [s.as_dict() for s in self.suggestions],
            "traffic": self.traffic.as_dict() if self.traffic is not None else None,
            "warnings": self.warnings,
        }


def _kv_layout(spec: ModelSpec) -> KVCacheLayout:
    """KV cache groups as the engine forms them (core/kv_cache_groups.py): a block holds
    group_size layers; a windowed group keeps only its window of a request."""
    windows = list(spec.layer_windows) or [None] * spec.num_layers
    return kv_cache_layout(windows, spec.recurrent_layers)


def state_slot_bytes(spec: ModelSpec, dtype_bytes: int, tp: int) -> int:
    """One state slot over every recurrent layer on one rank (worker/state_cache.py)."""
    model_elems, fp32_elems = spec.recurrent_state
    return len(spec.recurrent_layers) * (model_elems * dtype_bytes + fp32_elems * 4) // tp


def plan_rank(spec: ModelSpec, device: DeviceTarget, s: PlanSettings, rank: int = 0) -> RankPlan:
    tp, draft = s.tensor_parallel_size, s.draft
    weights = weight_bytes_per_rank(spec, s.dtype_bytes, tp, s.quantization)
    draft_weights = draft_per_token = 0
    if draft is not None:
        draft_weights = weight_bytes_per_rank(draft, s.dtype_bytes, 1, s.quantization).total
        draft_per_token = kv_bytes_per_token(_kv_layout(draft).num_tensors, draft.num_kv_heads,
                                             draft.head_dim, s.kv_value_bytes, 1,
                                             s.kv_scale_bytes)
    all_weights = weights.total + draft_weights
    activation = estimate_activation_bytes(spec, s.dtype_bytes, tp, s.max_num_batched_tokens,
                                           s.max_num_seqs)
    if device.kind == "cuda":
        budget = cuda_memory_budget(device.total_bytes, s.gpu_memory_utilization, all_weights,
                                    activation, estimate_overhead_bytes("cuda", tp))
    else:
        # NOTE: the engine measures free RAM after loading the weights; we subtract them.
        budget = cpu_memory_budget(s.kv_cache_memory, all_weights,
                                   max(0, device.total_bytes - all_weights), activation)
    layout = _kv_layout(spec)
    per_token = kv_bytes_per_token(layout.num_tensors, spec.num_kv_heads, spec.head_dim,
                                   s.kv_value_bytes, tp, s.kv_scale_bytes) + draft_per_token
    windowed = any(w is not None for w in layout.windows)
    request_blocks = (layout.blocks_for_tokens(s.max_model_len, s.block_size,
                                               s.max_num_batched_tokens) if windowed else 0)
    # As worker/kv_cache.plan_for_device: running state slots first, then the snapshots'
    # share, then blocks.
    slot = state_slot_bytes(spec, s.dtype_bytes, tp)
    state = slot * (s.max_num_seqs + 1) if slot else 0
    snapshots = bool(slot and s.enable_prefix_caching)
    blocks_budget = max(0, budget.kv_budget_bytes - state)
    if snapshots:
        blocks_budget = int(blocks_budget * (1 - STATE_SNAPSHOT_SHARE))
    kv = plan_kv_cache(blocks_budget, per_token, s.block_size, s.max_model_len,
                       s.num_gpu_blocks_override, request_blocks)
    snap_slots, interval = (state_snapshot_plan(kv.num_blocks, kv.bytes_per_block, slot,
                                                s.block_size)
                            if snapshots else (0, 1))
    attention_layers = (len(spec.layer_windows) or spec.num_layers) - len(spec.recurrent_layers)
    full_per_token = kv_bytes_per_token(attention_layers, spec.num_kv_heads, spec.head_dim,
                                        s.kv_value_bytes, tp, s.kv_scale_bytes) + draft_per_token
    full_blocks = -(-s.max_model_len // s.block_size)
    return RankPlan(rank, weights, budget, kv,
                    request_kv_bytes=kv.blocks_per_max_len_request * kv.bytes_per_block,
                    request_kv_bytes_full=full_blocks * s.block_size * full_per_token,
                    draft_weight_bytes=draft_weights, draft_kv_bytes_per_token=draft_per_token,
                    state_slot_bytes=slot, state_bytes=state, snapshot_slots=snap_slots,
                    snapshot_interval_tokens=interval * s.block_size if snap_slots else 0)


def plan_ranks(spec: ModelSpec, device: DeviceTarget, s: PlanSettings) -> list[RankPlan]:
    """Every rank holds the same shard sizes (vocab padded to a multiple of tp), so one plan
    is computed and repeated per rank."""
    one = plan_rank(spec, device, s)
    return [replace(one, rank=r) for r in range(s.tensor_parallel_size)]


def draft_model_spec(speculative_config: SpeculativeConfig | None) -> ModelSpec | None:
    """The draft model's spec when speculative decoding uses one (``method: draft_model``)."""
    if speculative_config is None or speculative_config.method != "draft_model":
        return None
    return load_model_spec(speculative_config.model)[0]


def resolve_settings(args: EngineArgs, spec: ModelSpec, device: DeviceTarget,
                     quantization: str = "none") -> PlanSettings:
    """EngineArgs -> PlanSettings with the engine's defaults and checks (see
    EngineArgs.create_engine_config, which needs the whole transformers config)."""
    import torch

    from pagellm.config import parse_size, resolve_dtype
    from pagellm.engine_args import check_cache_flags, resolve_scheduler_limits
    from pagellm.spec_decode.config import check_speculative_combination

    check_cache_flags(args)
    speculative = parse_speculative_config(args.speculative_config)
    check_speculative_combination(speculative, args.tensor_parallel_size, args.async_scheduling)
    max_model_len, max_num_seqs, batched = resolve_scheduler_limits(args, spec.context_len)
    dtype = resolve_dtype(args.dtype, _DtypeHint(spec.config_dtype), torch.device(device.kind))
    return PlanSettings(
        dtype=str(dtype).removeprefix("torch."), quantization=quantization,
        tensor_parallel_size=args.tensor_parallel_size, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=batched, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=parse_size(args.kv_cache_memory),
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        draft=draft_model_spec(speculative),
        kv_cache_dtype=parse_kv_cache_dtype(args.kv_cache_dtype).name,
        enable_prefix_caching=bool(args.enable_prefix_caching))


@dataclass(frozen=True)
class _DtypeHint:
    """What resolve_dtype reads from a transformers config."""

    torch_dtype: Any


def plan_from_args(args: EngineArgs, device: str = "auto",
                   quantization: str = "none") -> PlanReport:
    """``pagellm plan``: read the config, resolve the flags, plan every rank, add warnings."""
    spec, _ = load_model_spec(args.model)
    target = parse_device(device)
    settings = resolve_settings(args, spec, target, quantization)
    report = PlanReport(spec, target, settings, plan_ranks(spec, target, settings))
    if not spec.engine_supported:
        report.warnings.append(f"{spec.architecture} is not an architecture the engine runs; "
                               "the estimate assumes a Llama-style layout.")
    if quantization != "none":
        report.warnings.append(f"--quantization {quantization} is a what-if: the engine loads "
                               "weights in the model dtype today.")
    if spec.checkpoint_format.startswith("gguf"):
        report.warnings.append(f"the checkpoint is {spec.checkpoint_format}; the engine "
                               f"dequantizes it to {settings.dtype} when loading.")
    if target.kind == "cpu":
        need = report.ranks[0].weights.total + report.ranks[0].kv.kv_budget_bytes
        if need > target.total_bytes:
            report.warnings.append("weights + KV cache exceed the host memory available now.")
    return report


def planned_for_engine(config: EngineConfig, measured: MemoryBudget) -> RankPlan:
    """The plan `pagellm plan` would print for a running engine's config on its device; the
    device memory is the measured one (on CPU: free RAM before the weights were loaded)."""
    m, c, sch = config.model, config.cache, config.scheduler
    spec = ModelSpec.from_hf_config(m.hf_config, m.served_model_name)
    kind = config.device.device.type
    settings = PlanSettings(
        dtype=str(m.dtype).removeprefix("torch."), quantization="none",
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        max_model_len=m.max_model_len, max_num_seqs=sch.max_num_seqs,
        max_num_batched_tokens=sch.max_num_batched_tokens, block_size=c.block_size,
        gpu_memory_utilization=c.gpu_memory_utilization, kv_cache_memory=c.kv_cache_memory,
        num_gpu_blocks_override=c.num_gpu_blocks_override,
        draft=draft_model_spec(config.speculative_config), kv_cache_dtype=c.cache_dtype,
        enable_prefix_caching=c.enable_prefix_caching)
    total = measured.total_bytes + (measured.weight_bytes if kind == "cpu" else 0)
    target = DeviceTarget(str(config.device.device), kind, total, "this device")
    return plan_rank(spec, target, settings)
