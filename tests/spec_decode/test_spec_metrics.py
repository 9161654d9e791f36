"""The acceptance counters: Prometheus names and increments, and the periodic log line."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagellm.metrics.logger import LoggingStatLogger
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.stats import SchedulerStats, SpecDecodingStats


def _samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(logger.render()[0].decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _stats(observations: list[tuple[int, int]]) -> SchedulerStats:
    spec = SpecDecodingStats(3)
    for drafts, accepted in observations:
        spec.observe(drafts, accepted)
    return SchedulerStats(num_running_reqs=1, spec_decoding=spec)


def test_prometheus_counters_with_vllm_names() -> None:
    p = PrometheusStatLogger("m", max_model_len=64, num_speculative_tokens=3)
    p.record(_stats([(3, 2), (3, 0)]), None)
    p.record(_stats([(3, 2), (3, 0), (2, 2)]), None)  # cumulative: only the new step counts
    s = _samples(p)
    assert s[("pagellm:spec_decode_num_drafts_total", ())] == 3
    assert s[("pagellm:spec_decode_num_draft_tokens_total", ())] == 8
    assert s[("pagellm:spec_decode_num_accepted_tokens_total", ())] == 4
    per_pos = [s[("pagellm:spec_decode_num_accepted_tokens_per_pos_total",
                  (("position", str(i)),))] for i in range(3)]
    assert per_pos == [2, 2, 0]
    # Off: no such series.
    off = PrometheusStatLogger("m", max_model_len=64)
    off.record(SchedulerStats(), None)
    assert not any("spec_decode" in name for name, _ in _samples(off))


def test_log_line_over_the_interval() -> None:
    clock = iter([0.0, 2.0, 4.0, 6.0])
    log = LoggingStatLogger(clock=lambda: next(clock))
    log.record(_stats([(3, 3), (3, 1)]), None)
    line = log.log() or ""
    assert ("SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 2.00 "
            "tokens/s, Drafted throughput: 3.00 tokens/s, Accepted: 4 tokens, Drafted: 6 tokens, "
            "Per-position acceptance rate: 1.000, 0.500, 0.500, Avg Draft acceptance rate: "
            "66.7%") in line
    log.record(_stats([(3, 3), (3, 1), (3, 0)]), None)
    line = log.log() or ""
    assert "Mean acceptance length: 1.00" in line and "Drafted: 3 tokens" in line
