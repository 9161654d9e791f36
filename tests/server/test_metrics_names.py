"""--metrics-names vllm|pagellm|both: a real `pagellm serve` in modes both (the default) and vllm,
known traffic through the openai client, /metrics read with prometheus_client's own parser. Each
count is checked against the responses (usage, finish reasons, what was asked for); every series
under vLLM's names has vLLM's labels (model_name, engine="0") and buckets, and each mode serves
only its prefixes. Mode pagellm (the same flag, the other prefix), several engines (the data
parallel API) and speculative decoding are checked on the logger in-process."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerProcess, wait_until

from pagellm.core.sched_output import EngineCoreOutput
from pagellm.entrypoints.cli import build_parser
from pagellm.metrics.metric_specs import ENGINE_METRICS, build_1_2_5_buckets
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.request_stats import RequestStatsTracker
from pagellm.metrics.stats import SchedulerStats, SpecDecodingStats

MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len",
        str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
        "--enable-prompt-tokens-details"]
PROMPT = "the quick brown fox jumps over the lazy dog " * 4
K = 2  # plain completions after the probe
LATENCY_HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_inference_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds",
                      "request_time_per_output_token_seconds")


@dataclasses.dataclass
class Traffic:
    """What the client sent and got back, per sample (n = 2 counts two)."""

    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    completion_tokens: list[int] = dataclasses.field(default_factory=list)
    max_tokens: list[int] = dataclasses.field(default_factory=list)
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0  # prefix-cache hits, per sample (see add)
    n_params: list[int] = dataclasses.field(default_factory=list)  # one per request
    max_generation_tokens: list[int] = dataclasses.field(default_factory=list)

    def add(self, response, max_tokens: int, n: int = 1) -> None:
        for choice in response.choices:
            self.finish_reasons.append(choice.finish_reason)
            self.max_tokens.append(max_tokens)
        usage = response.usage
        # usage counts the prompt once and every sample's tokens; per sample, each sample's.
        per_sample = [usage.completion_tokens // n] * n
        assert sum(per_sample) == usage.completion_tokens
        self.prompt_tokens += [usage.prompt_tokens] * n
        self.completion_tokens += per_sample
        # usage reports sample 0's hit; its n - 1 siblings look the prompt up after it and
        # hit its full blocks (all but a last partial or full block, which is computed).
        full_blocks = (usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        self.cached_tokens += usage.prompt_tokens_details.cached_tokens + (n - 1) * full_blocks
        self.n_params.append(n)
        self.max_generation_tokens.append(max(per_sample))


@dataclasses.dataclass
class Scrape:
    mode: str
    model: str
    traffic: Traffic
    families: dict[str, object]  # family name -> prometheus_client Metric

    def samples(self, family: str) -> list:
        return self.families[family].samples

    def value(self, sample_name: str, family: str | None = None, **labels: str) -> float:
        """The one sample of ``sample_name`` whose labels include ``labels``."""
        family = family or sample_name
        hits = [s for s in self.samples(family) if s.name == sample_name
                and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(hits) == 1, (sample_name, labels, hits)
        return hits[0].value


def send_traffic(base_url: str) -> tuple[str, Traffic]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    traffic = Traffic()
    greedy = {"model": model, "prompt": PROMPT, "temperature": 0}
    probe = client.completions.create(**greedy, max_tokens=8, extra_body={"ignore_eos": True})
    traffic.add(probe, 8)
    for _ in range(K):
        traffic.add(client.completions.create(**greedy, max_tokens=6,
                                              extra_body={"ignore_eos": True}), 6)
    # Greedy again: the probe's text comes back, so a stop string from its middle ends it
    # before max_tokens (a stop in the last token is reported as "length" in the metrics).
    text = probe.choices[0].text
    stop = text[len(text) // 3:len(text) // 2]
    assert stop.strip(), text
    stopped = client.completions.create(**greedy, max_tokens=8, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < 8
    traffic.add(stopped, 8)
    traffic.add(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, n=2,
                                          temperature=1.0, seed=7,
                                          extra_body={"ignore_eos": True}), 4, n=2)
    return model, traffic


@pytest.fixture(scope="module", params=["both", "vllm"])
def scrape(request, tiny_llama_dir, tmp_path_factory) -> Iterator[Scrape]:
    mode = request.param
    log = tmp_path_factory.mktemp(f"metrics_{mode}") / "server.log"
    srv = ServerProcess([str(tiny_llama_dir), *ARGS, "--metrics-names", mode], log)
    try:
        model, traffic = send_traffic(srv.base_url)
        requests = len(traffic.finish_reasons)

        def read() -> dict[str, object]:
            text = httpx.get(f"{srv.base_url}/metrics", timeout=30).text
            return {f.name: f for f in text_string_to_metric_families(text)}

        # A stop string's sample finishes in the front end before the engine's last step
        # output is read: wait until every sample is counted and the engine is idle.
        prefix = "pagellm" if mode == "pagellm" else "vllm"

        def settled() -> bool:
            fams = read()
            done = sum(s.value for s in fams[f"{prefix}:request_success"].samples
                       if s.name.endswith("_total"))
            running = sum(s.value for s in fams[f"{prefix}:num_requests_running"].samples)
            return done == requests and running == 0

        assert wait_until(settled, timeout_s=30)
        yield Scrape(mode, model, traffic, read())
    finally:
        srv.stop()


def prefixes_of(mode: str) -> tuple[str, ...]:
    return {"both": ("vllm", "pagellm"), "vllm": ("vllm",), "pagellm": ("pagellm",)}[mode]


def test_only_the_chosen_prefixes_are_served(scrape: Scrape) -> None:
    served = {name.split(":")[0] for name in scrape.families if ":" in name}
    assert served == set(prefixes_of(scrape.mode))
    for prefix in prefixes_of(scrape.mode):
        # The text format gives each counter's and histogram's _created its own family.
        names = {name.split(":", 1)[1] for name in scrape.families
                 if name.startswith(prefix + ":") and not name.endswith("_created")}
        # The whole table (no speculative decoding here) plus cache_config_info.
        assert names == {s.name for s in ENGINE_METRICS} | {"cache_config_info"}, prefix


def test_vllm_label_sets_and_types(scrape: Scrape) -> None:
    if "vllm" not in prefixes_of(scrape.mode):
        pytest.skip("no vllm: names in this mode")
    types = {s.name: s.kind for s in ENGINE_METRICS}
    for name, family in scrape.families.items():
        if not name.startswith("vllm:") or name == "vllm:cache_config_info":
            continue
        if name.endswith("_created"):
            assert name.removesuffix("_created") in scrape.families
            continue
        assert family.type == types[name.split(":", 1)[1]], name
        for s in family.samples:
            assert s.labels["model_name"] == scrape.model and s.labels["engine"] == "0", s
    # A finish reason label on request_success only; le on histogram buckets only.
    reasons = {s.labels["finished_reason"] for s in scrape.samples("vllm:request_success")
               if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error"}


def test_pagellm_names_keep_their_label_set(scrape: Scrape) -> None:
    if "pagellm" not in prefixes_of(scrape.mode):
        pytest.skip("no pagellm: names in this mode")
    for name, family in scrape.families.items():
        if name.startswith("pagellm:") and name != "pagellm:cache_config_info":
            for s in family.samples:
                assert s.labels["model_name"] == scrape.model and "engine" not in s.labels, s


def test_counts_match_the_traffic(scrape: Scrape) -> None:
    t = scrape.traffic
    requests = len(t.finish_reasons)
    for p in prefixes_of(scrape.mode):
        v = scrape.value
        assert v(f"{p}:request_success_total", f"{p}:request_success",
                 finished_reason="length") == t.finish_reasons.count("length") == requests - 1
        assert v(f"{p}:request_success_total", f"{p}:request_success",
                 finished_reason="stop") == 1
        assert v(f"{p}:request_success_total", f"{p}:request_success",
                 finished_reason="abort") == 0
        assert v(f"{p}:prompt_tokens_total", f"{p}:prompt_tokens") == sum(t.prompt_tokens)
        generated = sum(t.completion_tokens)
        assert v(f"{p}:generation_tokens_total", f"{p}:generation_tokens") == generated
        # Every sample is looked up once (its whole prompt); hits are what usage reported.
        # The same prompt each time: all but the first sample hit its full blocks.
        queries = v(f"{p}:prefix_cache_queries_total", f"{p}:prefix_cache_queries")
        hits = v(f"{p}:prefix_cache_hits_total", f"{p}:prefix_cache_hits")
        assert queries == sum(t.prompt_tokens)
        assert 0 < hits == t.cached_tokens < queries
        assert hits == (requests - 1) * ((t.prompt_tokens[0] - 1) // BLOCK_SIZE * BLOCK_SIZE)
        assert v(f"{p}:num_preemptions_total", f"{p}:num_preemptions") == 0
        assert v(f"{p}:num_requests_running") == v(f"{p}:num_requests_waiting") == 0
        assert v(f"{p}:kv_cache_usage_perc") == 0  # every block back in the pool


def test_histograms_count_every_request(scrape: Scrape) -> None:
    t = scrape.traffic
    requests = len(t.finish_reasons)
    for p in prefixes_of(scrape.mode):
        def count(name: str, p: str = p) -> float:
            return scrape.value(f"{p}:{name}_count", f"{p}:{name}")

        def total(name: str, p: str = p) -> float:
            return scrape.value(f"{p}:{name}_sum", f"{p}:{name}")

        for name in LATENCY_HISTOGRAMS:
            assert count(name) == requests, name
            assert total(name) >= 0, name
        # One inter-token gap per token after a sample's first (one token per step here).
        assert count("inter_token_latency_seconds") == sum(n - 1 for n in t.completion_tokens)
        assert count("request_prompt_tokens") == requests
        assert total("request_prompt_tokens") == sum(t.prompt_tokens)
        assert total("request_generation_tokens") == sum(t.completion_tokens)
        assert count("request_params_max_tokens") == requests
        assert total("request_params_max_tokens") == sum(t.max_tokens)
        # n and the most tokens of a request's samples: once per request, not per sample.
        assert count("request_params_n") == len(t.n_params) == requests - 1
        assert total("request_params_n") == sum(t.n_params)
        assert count("request_max_num_generation_tokens") == len(t.n_params)
        assert total("request_max_num_generation_tokens") == sum(t.max_generation_tokens)
        # Each engine step's output batch: its prompt and generated tokens.
        assert total("iteration_tokens_total") == sum(t.prompt_tokens) + sum(t.completion_tokens)
        assert count("iteration_tokens_total") >= max(t.completion_tokens)


def test_buckets_are_vllms(scrape: Scrape) -> None:
    p = prefixes_of(scrape.mode)[0]

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in scrape.samples(f"{p}:{name}")
                if s.name.endswith("_bucket")]

    inf = float("inf")
    assert bounds("request_prompt_tokens") == [*build_1_2_5_buckets(MAX_MODEL_LEN), inf]
    assert build_1_2_5_buckets(MAX_MODEL_LEN) == [1, 2, 5, 10, 20, 50, 100, 200]
    assert bounds("request_params_n") == [1, 2, 5, 10, 20, inf]
    assert bounds("iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                                4096, 8192, 16384, inf]
    assert bounds("time_to_first_token_seconds")[:3] == [0.001, 0.005, 0.01]
    assert bounds("time_to_first_token_seconds")[-2:] == [2560.0, inf]
    assert bounds("e2e_request_latency_seconds")[-2:] == [7680.0, inf]
    assert bounds("inter_token_latency_seconds")[-2:] == [80.0, inf]


def test_cache_config_info(scrape: Scrape) -> None:
    for p in prefixes_of(scrape.mode):
        (sample,) = scrape.samples(f"{p}:cache_config_info")
        assert sample.value == 1
        labels = sample.labels
        assert labels["engine"] == "0" and "model_name" not in labels
        assert labels["block_size"] == str(BLOCK_SIZE)
        assert labels["enable_prefix_caching"] == "True"
        assert labels["cache_dtype"] == "auto"
        # 16 MiB of KV at this tiny model's bytes per token, in blocks of 16 tokens.
        assert int(labels["num_gpu_blocks"]) > 0
        assert labels["kv_cache_memory_bytes"] == str(16 << 20)


def test_metrics_names_flag(capsys) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).metrics_names == "both"
    assert parser.parse_args(["serve", "--metrics-names", "vllm"]).metrics_names == "vllm"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["serve", "--metrics-names", "prometheus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--metrics-names" in err and "prometheus" in err
    with pytest.raises(ValueError, match="--metrics-names must be one of vllm, pagellm, both"):
        PrometheusStatLogger("m", 64, metric_names="prometheus")


def families_of(logger: PrometheusStatLogger) -> dict[str, object]:
    text = logger.render()[0].decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def one_finished_request(tracker: RequestStatsTracker, req_id: str) -> list:
    """Arrival at 0, scheduled at 1, tokens at 2 and 4 (length): the iterations' metrics."""
    tracker.add(req_id, 0.0, 5, max_tokens=2)
    return [tracker.update([EngineCoreOutput(req_id, [1])], {req_id: 1.0}, [], now=2.0),
            tracker.update([EngineCoreOutput(req_id, [2], "length")], {}, [], now=4.0)]


def test_pagellm_mode_and_several_engines_in_process() -> None:
    logger = PrometheusStatLogger("m", 64, engine_indexes=(0, 1), metric_names="pagellm",
                                  cache_config_info={"block_size": "16"})
    tracker = RequestStatsTracker()
    logger.record(SchedulerStats(num_running_reqs=2, prefix_cache_queries=10,
                                 prefix_cache_hits=4), None, engine_index=1)
    for it in one_finished_request(tracker, "a"):
        logger.record(SchedulerStats(), it, engine_index=1)
    fams = families_of(logger)
    assert all(name.startswith("pagellm:") for name in fams)

    def value(name: str, engine: str, family: str | None = None) -> float:
        (s,) = [s for s in fams[family or name].samples
                if s.name == name and s.labels == {"model_name": "m", "engine": engine}]
        return s.value

    # Several engines: the pagellm: names carry engine too, and each engine has its series.
    assert value("pagellm:prefix_cache_hits_total", "1", "pagellm:prefix_cache_hits") == 4
    assert value("pagellm:prefix_cache_hits_total", "0", "pagellm:prefix_cache_hits") == 0
    assert value("pagellm:num_requests_running", "1") == 0  # the last stats of engine 1
    timings = {"request_queue_time_seconds": 1.0, "request_prefill_time_seconds": 1.0,
               "request_decode_time_seconds": 2.0, "request_inference_time_seconds": 3.0,
               "e2e_request_latency_seconds": 4.0, "time_to_first_token_seconds": 2.0,
               "request_time_per_output_token_seconds": 2.0}
    for name, seconds in timings.items():
        family = f"pagellm:{name}"
        assert value(f"{family}_sum", "1", family) == seconds, name
        assert value(f"{family}_count", "0", family) == 0, name
    assert value("pagellm:request_params_max_tokens_sum", "1",
                 "pagellm:request_params_max_tokens") == 2
    assert value("pagellm:iteration_tokens_total_sum", "1",
                 "pagellm:iteration_tokens_total") == 5 + 2
    info = {s.labels["engine"]: s.labels for s in fams["pagellm:cache_config_info"].samples}
    assert info == {"0": {"block_size": "16", "engine": "0"},
                    "1": {"block_size": "16", "engine": "1"}}
    with pytest.raises(ValueError, match="engine_index 2"):
        logger.record(SchedulerStats(), None, engine_index=2)


def test_n_samples_count_once_for_n_and_max_generation_tokens() -> None:
    logger = PrometheusStatLogger("m", 64, metric_names="vllm")
    tracker = RequestStatsTracker()
    for i in range(3):
        tracker.add(f"r-{i}", 0.0, 4, max_tokens=5, n=3, group_id="r")
    logger.record(None, tracker.update([EngineCoreOutput("r-0", [1, 2], "stop"),
                                        EngineCoreOutput("r-1", [1, 2, 3])], {}, [], now=1.0))
    fams = families_of(logger)
    counts = {s.name: s.value for s in fams["vllm:request_params_n"].samples}
    assert counts["vllm:request_params_n_count"] == 0  # two of three samples unfinished
    logger.record(None, tracker.update([EngineCoreOutput("r-1", [4], "length")], {}, [],
                                       now=2.0))
    logger.record(None, tracker.abort(["r-2"], now=3.0))
    fams = families_of(logger)
    counts = {s.name: s.value for s in fams["vllm:request_params_n"].samples}
    assert (counts["vllm:request_params_n_count"], counts["vllm:request_params_n_sum"]) == (1, 3)
    most = {s.name: s.value for s in fams["vllm:request_max_num_generation_tokens"].samples}
    assert most["vllm:request_max_num_generation_tokens_sum"] == 4
    # The aborted sample never ran: no queue, prefill or decode time for it.
    assert {s.name: s.value for s in fams["vllm:request_prefill_time_seconds"].samples}[
        "vllm:request_prefill_time_seconds_count"] == 0
    assert {s.name: s.value for s in fams["vllm:e2e_request_latency_seconds"].samples}[
        "vllm:e2e_request_latency_seconds_count"] == 3


def test_spec_decode_counters_under_vllm_names() -> None:
    logger = PrometheusStatLogger("m", 64, num_speculative_tokens=2, metric_names="both")
    stats = SpecDecodingStats(2)
    stats.observe(2, 1)
    stats.observe(2, 2)
    logger.record(SchedulerStats(spec_decoding=stats.snapshot()), None)
    fams = families_of(logger)
    for p, labels in (("vllm", {"model_name": "m", "engine": "0"}),
                      ("pagellm", {"model_name": "m"})):
        drafts = fams[f"{p}:spec_decode_num_draft_tokens"].samples[0]
        assert (drafts.name, drafts.labels, drafts.value) == \
            (f"{p}:spec_decode_num_draft_tokens_total", labels, 4)
        per_pos = {s.labels["position"]: s.value
                   for s in fams[f"{p}:spec_decode_num_accepted_tokens_per_pos"].samples
                   if s.name.endswith("_total")}
        assert per_pos == {"0": 2, "1": 1}
