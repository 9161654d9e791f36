"""Metrics: request timing from output batches, Prometheus exposition, the periodic log line."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagellm.core.sched_output import EngineCoreOutput
from pagellm.metrics.logger import LoggingStatLogger
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.request_stats import RequestStatsTracker
from pagellm.metrics.stats import SchedulerStats


def samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple], float]:
    text = logger.render()[0].decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def test_a_stop_string_at_max_tokens_counts_as_stop():
    """The client is told "stop" when a stop string completes in the step that also reaches
    max_tokens (the engine says "length"); the success counter must agree with it."""
    from server_fakes import make_tokenizer

    from pagellm.engine.output_processor import OutputProcessor
    from pagellm.sampling_params import SamplingParams

    processor, stats = OutputProcessor(make_tokenizer()), RequestStatsTracker()
    params = SamplingParams(max_tokens=2, stop=["w3"], temperature=0.0)
    for rid in ("a", "b"):
        processor.add_request(rid, None, [1], params, [rid])
        stats.add(rid, arrival_time=0.0, num_prompt_tokens=1)
    outputs = [EngineCoreOutput("a", [2]), EngineCoreOutput("b", [2])]
    stats.update(outputs, {}, processor.process_outputs(outputs).stopped_by_string, now=1.0)
    # "a": the stop string and max_tokens in one step; "b": only max_tokens.
    outputs = [EngineCoreOutput("a", [3], "length"), EngineCoreOutput("b", [4], "length")]
    processed = processor.process_outputs(outputs)
    assert processed.reqs_to_stop == []  # the engine finished both itself
    told = {o.request_id: o.outputs[0].finish_reason for o in processed.request_outputs}
    assert told == {"a": "stop", "b": "length"}
    it = stats.update(outputs, {}, processed.stopped_by_string, now=2.0)
    assert {f.finish_reason for f in it.finished} == {"stop", "length"}
    assert sorted(f.finish_reason for f in it.finished) == sorted(told.values())


def test_tracker_timeline():
    t = RequestStatsTracker()
    t.add("a", arrival_time=10.0, num_prompt_tokens=5)
    t.add("b", arrival_time=10.5, num_prompt_tokens=7)
    it = t.update([EngineCoreOutput("a", [1])], {"a": 10.25}, [], now=11.0)
    assert it.num_prompt_tokens == 5 and it.num_generation_tokens == 1
    assert it.time_to_first_tokens == [1.0] and it.inter_token_latencies == []
    it = t.update([EngineCoreOutput("a", [2], "length"), EngineCoreOutput("b", [3])],
                  {"b": 11.0}, [], now=11.5)
    assert it.num_prompt_tokens == 7 and it.num_generation_tokens == 2
    assert it.time_to_first_tokens == [1.0] and it.inter_token_latencies == [0.5]
    (fa,) = it.finished
    assert (fa.finish_reason, fa.e2e_latency, fa.queue_time) == ("length", 1.5, 0.25)
    assert (fa.num_prompt_tokens, fa.num_generation_tokens) == (5, 2)
    # A stop string finishes "b" in the front end (no finish reason from the engine).
    it = t.update([EngineCoreOutput("b", [4])], {}, ["b"], now=12.5)
    assert [f.finish_reason for f in it.finished] == ["stop"]
    assert it.finished[0].queue_time == 0.5 and it.finished[0].num_generation_tokens == 2
    assert len(t) == 0
    t.add("c", arrival_time=0.0, num_prompt_tokens=3)
    it = t.abort(["c", "unknown"], now=4.0)
    assert [(f.finish_reason, f.e2e_latency, f.queue_time) for f in it.finished] == \
        [("abort", 4.0, None)]
    # Outputs of requests no longer tracked (aborted meanwhile) are ignored.
    assert t.update([EngineCoreOutput("c", [1])], {}, [], now=5.0).num_generation_tokens == 0


def test_prometheus_export():
    p = PrometheusStatLogger("m", max_model_len=1024)
    p.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5,
                            prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1),
             None)
    t = RequestStatsTracker()
    t.add("a", 0.0, 100)
    t.update([EngineCoreOutput("a", [1])], {"a": 0.5}, [], now=1.0)
    p.record(SchedulerStats(num_running_reqs=0, kv_cache_usage=0.0, prefix_cache_queries=25,
                            prefix_cache_hits=4, num_preemptions=3),
             t.update([EngineCoreOutput("a", [2, 3], "stop")], {}, [], now=3.0))
    s = samples(p)
    assert s[("pagellm:num_requests_running", ())] == 0
    assert s[("pagellm:num_requests_waiting", ())] == 0
    assert s[("pagellm:kv_cache_usage_perc", ())] == 0
    assert s[("pagellm:prefix_cache_queries_total", ())] == 25
    assert s[("pagellm:prefix_cache_hits_total", ())] == 4
    assert s[("pagellm:num_preemptions_total", ())] == 3
    assert s[("pagellm:prompt_tokens_total", ())] == 0  # only the second record had tokens
    assert s[("pagellm:generation_tokens_total", ())] == 2
    assert s[("pagellm:request_success_total", (("finished_reason", "stop"),))] == 1
    assert s[("pagellm:request_success_total", (("finished_reason", "abort"),))] == 0
    assert s[("pagellm:e2e_request_latency_seconds_sum", ())] == 3.0
    assert s[("pagellm:request_queue_time_seconds_sum", ())] == 0.5
    assert s[("pagellm:inter_token_latency_seconds_count", ())] == 1
    assert s[("pagellm:request_prompt_tokens_sum", ())] == 100
    assert s[("pagellm:request_generation_tokens_bucket", (("le", "2.0"),))] == 0
    assert s[("pagellm:request_generation_tokens_bucket", (("le", "5.0"),))] == 1
    assert s[("pagellm:time_to_first_token_seconds_count", ())] == 0  # first token not here


def test_log_line_every_interval_while_busy(caplog):
    now = [0.0]
    log = LoggingStatLogger(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="pagellm"):
        now[0] = 5.0
        assert log.log() is None  # idle: nothing to say
        t = RequestStatsTracker()
        t.add("a", 0.0, 40)
        log.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                                  prefix_cache_queries=40, prefix_cache_hits=10,
                                  num_preemptions=1),
                   t.update([EngineCoreOutput("a", [1, 2])], {}, [], now=6.0))
        now[0] = 10.0
        line = log.log()
        assert line is not None and line in caplog.text
        for part in ("prompt throughput 8.0 tokens/s", "generation throughput 0.4 tokens/s",
                     "running: 2 reqs", "waiting: 1 reqs", "KV cache usage: 25.0%",
                     "prefix cache hit rate: 25.0%", "preemptions: 1"):
            assert part in line, line
        log.record(SchedulerStats(), None)
        now[0] = 15.0
        assert "running: 0 reqs" in (log.log() or "")  # one line after going idle
        now[0] = 20.0
        assert log.log() is None


@pytest.mark.parametrize("reason", ["stop", "length", "abort", "error"])
def test_success_counter_labels(reason):
    p = PrometheusStatLogger("m", 16)
    t = RequestStatsTracker()
    t.add("a", 0.0, 1)
    it = t.abort(["a"], now=1.0, reason=reason) if reason in ("abort", "error") else \
        t.update([EngineCoreOutput("a", [1], reason)], {}, [], now=1.0)
    p.record(None, it)
    assert samples(p)[("pagellm:request_success_total", (("finished_reason", reason),))] == 1
