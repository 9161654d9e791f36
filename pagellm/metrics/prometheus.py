"""Prometheus collectors for /metrics: the table in metric_specs.py under ``vllm:``,
``pagellm:`` or both prefixes (``--metrics-names``).

Each PrometheusStatLogger owns its registry (no process-global state), which ``/metrics``
renders. One server may host several engines (data parallelism): every per-engine series of
the ``vllm:`` names carries ``engine`` (vLLM's label set: model_name, engine). The ``pagellm:``
names keep their label set, model_name alone, and gain ``engine`` only when the logger has
several engines (their series could not be told apart otherwise).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pagellm.metrics.metric_specs import (
    CACHE_CONFIG_INFO,
    DEFAULT_METRIC_NAMES,
    ENGINE_METRICS,
    FINISH_REASONS,
    SPEC_DECODE_METRICS,
    MetricSpec,
    prefixes,
)
from pagellm.metrics.request_stats import IterationMetrics
from pagellm.metrics.stats import SchedulerStats, SpecDecodingStats

__all__ = ["FINISH_REASONS", "PrometheusStatLogger"]

_KINDS = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}


class _Series:
    """One series under every enabled prefix: each update reaches all of them."""

    __slots__ = ("children",)

    def __init__(self, children: Iterable) -> None:
        self.children = tuple(children)

    def inc(self, amount: float) -> None:
        for child in self.children:
            child.inc(amount)

    def set(self, value: float) -> None:
        for child in self.children:
            child.set(value)

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class _EngineSeries:
    """One engine's series, and the last cumulative counts the scheduler reported (Prometheus
    counters take increments)."""

    def __init__(self, series: dict[str, _Series], success: dict[str, _Series],
                 spec: _SpecDecodingSeries | None) -> None:
        self.m = series
        self.success = success
        self.spec = spec
        self.last_queries = self.last_hits = self.last_preemptions = 0


class _SpecDecodingSeries:
    """vLLM's speculative-decoding counters, fed with the scheduler's cumulative ones."""

    def __init__(self, m: dict[str, _Series], per_pos: list[_Series],
                 num_spec_tokens: int) -> None:
        self.m = m
        self.per_pos = per_pos
        self.last = SpecDecodingStats(num_spec_tokens)

    def record(self, stats: SpecDecodingStats) -> None:
        delta = stats.since(self.last)
        self.m["spec_decode_num_drafts"].inc(max(0, delta.num_drafts))
        self.m["spec_decode_num_draft_tokens"].inc(max(0, delta.num_draft_tokens))
        self.m["spec_decode_num_accepted_tokens"].inc(max(0, delta.num_accepted_tokens))
        for series, n in zip(self.per_pos, delta.num_accepted_tokens_per_pos, strict=True):
            series.inc(max(0, n))
        self.last = stats


class PrometheusStatLogger:
    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None, num_speculative_tokens: int = 0,
                 engine_indexes: Sequence[int] = (0,),
                 metric_names: str = DEFAULT_METRIC_NAMES,
                 cache_config_info: dict[str, str] | None = None) -> None:
        """``num_speculative_tokens`` > 0 (speculative decoding on): the acceptance counters
        too. ``cache_config_info``: the labels of ``cache_config_info`` (None: not exported).
        ``metric_names``: vllm, pagellm or both (ValueError naming --metrics-names else)."""
        self.prefixes = prefixes(metric_names)
        if not engine_indexes or len(set(engine_indexes)) != len(engine_indexes):
            raise ValueError(f"engine_indexes must be distinct and non-empty, got "
                             f"{list(engine_indexes)}.")
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.engine_indexes = tuple(engine_indexes)
        self._pagellm_engine_label = len(self.engine_indexes) > 1
        families = {s.name: self._family(s) for s in ENGINE_METRICS}
        spec_families = ({s.name: self._family(s) for s in SPEC_DECODE_METRICS}
                         if num_speculative_tokens > 0 else None)
        self._engines: dict[int, _EngineSeries] = {}
        for idx in self.engine_indexes:
            series = {name: self._bind(fam, idx) for name, fam in families.items()
                      if name != "request_success"}
            success = {r: self._bind(families["request_success"], idx, finished_reason=r)
                       for r in FINISH_REASONS}
            spec = None
            if spec_families is not None:
                per_pos_family = spec_families["spec_decode_num_accepted_tokens_per_pos"]
                spec = _SpecDecodingSeries(
                    {name: self._bind(fam, idx) for name, fam in spec_families.items()
                     if fam is not per_pos_family},
                    [self._bind(per_pos_family, idx, position=str(pos))
                     for pos in range(num_speculative_tokens)], num_speculative_tokens)
            self._engines[idx] = _EngineSeries(series, success, spec)
        if cache_config_info is not None:
            self._export_cache_config_info(cache_config_info)
        # The first engine's collectors under the first prefix, for in-process readers (tests).
        first = self._engines[self.engine_indexes[0]]
        self.running = first.m["num_requests_running"].children[0]
        self.prompt_tokens = first.m["prompt_tokens"].children[0]
        self.generation_tokens = first.m["generation_tokens"].children[0]
        self.ttft = first.m["time_to_first_token_seconds"].children[0]
        self.success = {r: s.children[0] for r, s in first.success.items()}

    # ---- building --------------------------------------------------------------------------
    def _base_labels(self, prefix: str) -> list[str]:
        if prefix == "vllm" or self._pagellm_engine_label:
            return ["model_name", "engine"]
        return ["model_name"]

    def _family(self, spec: MetricSpec) -> list[tuple[str, Gauge | Counter | Histogram]]:
        """The spec's collector under each prefix, with that prefix's label names."""
        out = []
        for prefix in self.prefixes:
            kwargs = {}
            if spec.kind == "histogram":
                assert spec.buckets is not None
                buckets = spec.buckets
                kwargs["buckets"] = (buckets(self.max_model_len) if callable(buckets)
                                     else list(buckets))
            collector = _KINDS[spec.kind](f"{prefix}:{spec.name}", spec.doc,
                                          [*self._base_labels(prefix), *spec.labels],
                                          registry=self.registry, **kwargs)
            out.append((prefix, collector))
        return out

    def _bind(self, family: list[tuple[str, Gauge | Counter | Histogram]], engine_index: int,
              **extra: str) -> _Series:
        children = []
        for prefix, collector in family:
            labels = {"model_name": self.model_name, **extra}
            if "engine" in self._base_labels(prefix):
                labels["engine"] = str(engine_index)
            children.append(collector.labels(**labels))
        return _Series(children)

    def _export_cache_config_info(self, info: dict[str, str]) -> None:
        if "engine" in info:
            raise ValueError("cache_config_info: 'engine' is set per engine, not a config key.")
        for prefix in self.prefixes:
            gauge = Gauge(f"{prefix}:{CACHE_CONFIG_INFO.name}", CACHE_CONFIG_INFO.doc,
                          [*info, "engine"], registry=self.registry)
            for idx in self.engine_indexes:
                gauge.labels(**info, engine=str(idx)).set(1)

    # ---- recording -------------------------------------------------------------------------
    def record(self, scheduler_stats: SchedulerStats | None,
               iteration: IterationMetrics | None, engine_index: int = 0) -> None:
        try:
            e = self._engines[engine_index]
        except KeyError:
            raise ValueError(f"engine_index {engine_index} is not one of this logger's engines "
                             f"{list(self.engine_indexes)}.") from None
        m = e.m
        if scheduler_stats is not None:
            s = scheduler_stats
            m["num_requests_running"].set(s.num_running_reqs)
            m["num_requests_waiting"].set(s.num_waiting_reqs)
            m["kv_cache_usage_perc"].set(s.kv_cache_usage)
            m["prefix_cache_queries"].inc(max(0, s.prefix_cache_queries - e.last_queries))
            m["prefix_cache_hits"].inc(max(0, s.prefix_cache_hits - e.last_hits))
            m["num_preemptions"].inc(max(0, s.num_preemptions - e.last_preemptions))
            e.last_queries = s.prefix_cache_queries
            e.last_hits = s.prefix_cache_hits
            e.last_preemptions = s.num_preemptions
            if e.spec is not None and s.spec_decoding is not None:
                e.spec.record(s.spec_decoding)
            if iteration is not None:
                # One observation per engine step's outputs (aborts recorded alone are none).
                m["iteration_tokens_total"].observe(iteration.num_prompt_tokens
                                                    + iteration.num_generation_tokens)
        if iteration is None:
            return
        it = iteration
        m["prompt_tokens"].inc(it.num_prompt_tokens)
        m["generation_tokens"].inc(it.num_generation_tokens)
        for v in it.time_to_first_tokens:
            m["time_to_first_token_seconds"].observe(v)
        for v in it.inter_token_latencies:
            m["inter_token_latency_seconds"].observe(v)
        for n in it.n_params:
            m["request_params_n"].observe(n)
        for n in it.max_num_generation_tokens:
            m["request_max_num_generation_tokens"].observe(n)
        for f in it.finished:
            e.success[f.finish_reason].inc(1)
            m["e2e_request_latency_seconds"].observe(f.e2e_latency)
            m["request_prompt_tokens"].observe(f.num_prompt_tokens)
            m["request_generation_tokens"].observe(f.num_generation_tokens)
            if f.max_tokens_param:
                m["request_params_max_tokens"].observe(f.max_tokens_param)
            # Times a request never reached (aborted while waiting, or before its first
            # token) are not observed.
            for name, value in (("request_queue_time_seconds", f.queue_time),
                                ("request_prefill_time_seconds", f.prefill_time),
                                ("request_decode_time_seconds", f.decode_time),
                                ("request_inference_time_seconds", f.inference_time),
                                ("request_time_per_output_token_seconds",
                                 f.mean_time_per_output_token)):
                if value is not None:
                    m[name].observe(value)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
