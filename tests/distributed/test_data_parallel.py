"""Data parallelism as vLLM spells it: `pagellm serve --data-parallel-size 2` runs two engine
processes behind one port (checked from the engines' own metrics, /proc and the server's log),
its greedy answers equal a single-engine server's, a disconnect frees the right engine, a prefix
cache reset reaches both, one engine killed makes /health fail; `--data-parallel-rank R`
servers run one engine each and label their metrics with R. Plus the load-balancing choice,
the weight-update and stats combination, and the refusals, as units."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_utils import ServerProcess, metric, pid_alive, scrape, wait_until  # noqa: E402

from pagellm import LLM  # noqa: E402
from pagellm.engine.data_parallel import check_data_parallel, engine_config, split_cpus  # noqa: E402
from pagellm.engine.dp_client import (  # noqa: E402
    EngineLoad,
    choose_engine,
    combine_weight_updates,
    merge_stats,
)
from pagellm.engine_args import EngineArgs  # noqa: E402
from pagellm.entrypoints.openai.cli_serve import add_serve_parser  # noqa: E402
from pagellm.errors import WeightUpdateError  # noqa: E402
from pagellm.metrics.stats import SchedulerStats  # noqa: E402

# A 4,096-token context and a model a few times the tiny one's size (milliseconds a token
# on one core) keep a disconnected stream's request running through the checks.
ARGS = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "4096",
        "--disable-log-stats"]
SLOWER = dict(max_position_embeddings=4096, hidden_size=128, intermediate_size=512,
              num_hidden_layers=4)
PROMPTS = ["hello world", "the quick brown fox", "a b c d e f", "one two three"]
# Long enough that two requests sent together overlap on the engines (64 tokens each).
LONG = {"max_tokens": 64, "ignore_eos": True, "temperature": 0}


# ---- units ---------------------------------------------------------------------------------
def test_least_loaded_engine_wins_and_waiting_costs_four_running():
    assert choose_engine([EngineLoad(), EngineLoad()]) == 0  # the first of equals
    assert choose_engine([EngineLoad(running=3), EngineLoad(waiting=1)]) == 0  # 3 < 4
    assert choose_engine([EngineLoad(running=5), EngineLoad(waiting=1)]) == 1  # 5 > 4
    # Sent and not yet received counts as waiting; received ones are in the engine's counts.
    assert choose_engine([EngineLoad(sent=1), EngineLoad(running=3)]) == 1
    assert choose_engine([EngineLoad(sent=2, received=2, running=2), EngineLoad(running=3)]) == 0


def test_cpus_are_split_into_disjoint_shares():
    assert split_cpus([3, 0, 1, 2], 2) == [(0, 1), (2, 3)]
    assert split_cpus([0, 1, 2], 2) == [(0,), (1,)]
    assert split_cpus([5], 3) == [(5,), (5,), (5,)]  # fewer CPUs than engines: shared


def test_weight_updates_are_all_or_nothing_over_the_ranks():
    assert combine_weight_updates([7, 7], (0, 1)) == 7
    bad = ValueError("model_path 'x' is not a checkpoint")
    with pytest.raises(ValueError, match="not a checkpoint"):
        combine_weight_updates([bad, bad], (0, 1))  # nothing changed anywhere
    restored = WeightUpdateError("restored", restored=True)
    with pytest.raises(WeightUpdateError) as e:
        combine_weight_updates([restored, restored], (0, 1))
    assert e.value.restored
    with pytest.raises(WeightUpdateError) as e:  # rank 0 on new weights, rank 1 on old ones
        combine_weight_updates([7, restored], (0, 1))
    assert not e.value.restored and "rank(s) [0] but not on [1]" in str(e.value)
    lost = WeightUpdateError("lost", restored=False)
    with pytest.raises(WeightUpdateError, match="lost"):
        combine_weight_updates([restored, lost], (0, 1))


def test_server_stats_sum_the_engines():
    merged = merge_stats([SchedulerStats(2, 1, 0.5, 10, 4, 1, 7),
                          SchedulerStats(1, 3, 0.25, 6, 2, 0, 5)])
    assert (merged.num_running_reqs, merged.num_waiting_reqs, merged.prefix_cache_queries,
            merged.prefix_cache_hits, merged.num_preemptions, merged.num_steps) == \
        (3, 4, 16, 6, 1, 12)
    assert merged.kv_cache_usage == pytest.approx(0.375)


def test_bad_sizes_and_ranks_are_refused_naming_the_flag():
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match="--data-parallel-size must be >= 1"):
        check_data_parallel(0, None, 1, cpu, "auto")
    with pytest.raises(ValueError, match="give --data-parallel-size N too"):
        check_data_parallel(1, 0, 1, cpu, "auto")
    with pytest.raises(ValueError, match="between 0 and 1 .*got 2"):
        check_data_parallel(2, 2, 1, cpu, "auto")
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        check_data_parallel(2, None, 2, cuda, "auto", num_cuda_devices=3)
    with pytest.raises(ValueError, match="--device cuda:1 with --data-parallel-size 2"):
        check_data_parallel(2, None, 1, cuda, "cuda:1", num_cuda_devices=4)
    check_data_parallel(2, None, 2, cuda, "cuda", num_cuda_devices=4)
    check_data_parallel(4, 3, 2, cuda, "auto", num_cuda_devices=2)  # one rank: its own GPUs


def test_each_rank_gets_its_rank_seed_and_kv_share(tiny_llama_dir):
    config = EngineArgs(model=str(tiny_llama_dir), seed=5,
                        data_parallel_size=2).create_engine_config()
    assert config.parallel.engine_ranks == (0, 1) and not config.parallel.data_parallel_external_lb
    rank1 = engine_config(config, 1, cpu_kv_share=2**20)
    assert (rank1.parallel.data_parallel_rank, rank1.model.seed) == (1, 6)
    assert rank1.cache.kv_cache_memory == 2**20  # the default budget, split
    given = EngineArgs(model=str(tiny_llama_dir), data_parallel_size=2,
                       kv_cache_memory="8MiB").create_engine_config()
    assert engine_config(given, 1, cpu_kv_share=2**20).cache.kv_cache_memory == 8 * 2**20
    external = EngineArgs(model=str(tiny_llama_dir), data_parallel_size=4,
                          data_parallel_rank=3).create_engine_config()
    assert external.parallel.engine_ranks == (3,) and external.parallel.data_parallel_external_lb
    with pytest.raises(ValueError, match="between 0 and 3"):
        EngineArgs(model=str(tiny_llama_dir), data_parallel_size=4,
                   data_parallel_rank=4).create_engine_config()


def test_offline_llm_refuses_data_parallelism(tiny_llama_dir):
    with pytest.raises(ValueError, match="is for `pagellm serve`"):
        LLM(model=str(tiny_llama_dir), data_parallel_size=2)


def test_vllm_spellings_parse_and_multi_node_flags_are_refused(capsys):
    parser = argparse.ArgumentParser(prog="pagellm")
    add_serve_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["serve", "M", "-dp", "2", "-dpn", "1", "-tp", "1"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.data_parallel_size, args.data_parallel_rank) == (2, 1)
    for flag in (["--data-parallel-address", "10.0.0.1"], ["--data-parallel-rpc-port", "13345"],
                 ["--data-parallel-size-local", "1"], ["--headless"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["serve", "M", "-dp", "2", *flag])
        assert e.value.code == 2
        assert f"{flag[0]}: pagellm does not run data parallelism across machines" in \
            capsys.readouterr().err


# ---- real servers --------------------------------------------------------------------------
def start(tmp_path: Path, name: str, model: Path, *extra: str) -> ServerProcess:
    return ServerProcess([str(model), *ARGS, *extra], tmp_path / f"{name}.log")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, make_tiny_model):
    """The -dp 2 server, then the servers of ranks 0 and 1 of an externally balanced
    deployment of 2 (single-engine servers), all of one tiny model, started together."""
    tmp = tmp_path_factory.mktemp("dp")
    model = make_tiny_model(tmp / "model", "llama", **SLOWER)
    flags = [("dp2", "--data-parallel-size", "2", "--enable-prefix-caching",
              "--enable-admin-routes"),
             *((f"rank{r}", "--data-parallel-size", "2", "--data-parallel-rank", str(r))
               for r in (0, 1))]
    with concurrent.futures.ThreadPoolExecutor(len(flags)) as pool:
        futures = [pool.submit(start, tmp, name, model, *extra) for name, *extra in flags]
        srvs = [f.result() for f in futures]
    try:
        yield srvs
    finally:
        for srv in srvs:
            srv.stop()


def engine_pids(srv: ServerProcess) -> dict[int, int]:
    return {int(r): int(p) for r, p in
            re.findall(r"Data-parallel rank (\d+): engine core pid (\d+)", srv.log())}


def complete(base_url: str, prompt: str, **body) -> dict:
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": prompt, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def together(base_url: str, prompts: list[str], **body) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(base_url, p, **body), prompts))


def per_engine(base_url: str, name: str, **labels: str) -> tuple[float, float]:
    m = scrape(base_url)
    return tuple(metric(m, name, engine=str(e), **labels) for e in (0, 1))  # type: ignore


def test_two_engine_processes_on_their_own_cpus(servers):
    dp, *_ = servers
    pids = engine_pids(dp)
    assert sorted(pids) == [0, 1] and all(pid_alive(p) for p in pids.values())
    cpus = [os.sched_getaffinity(pids[r]) for r in (0, 1)]
    assert cpus[0] and cpus[1] and not cpus[0] & cpus[1]
    assert len(re.findall(r"Engine core process started", dp.log())) == 2


def test_concurrent_requests_are_spread_over_both_engines(servers):
    dp, *_ = servers
    before = per_engine(dp.base_url, "pagellm:request_success_total")
    together(dp.base_url, PROMPTS, **LONG)
    after = per_engine(dp.base_url, "pagellm:request_success_total")
    done = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(done) == 4 and min(done) >= 1, done  # each engine's own count
    assert httpx.get(f"{dp.base_url}/get_load").json() == {"load": 0}


def test_greedy_answers_equal_a_single_engine_servers(servers):
    dp, single, _ = servers  # rank 0 of the external deployment: one engine, seed + 0
    body = {"max_tokens": 24, "temperature": 0}
    got = [c["choices"][0]["text"] for c in together(dp.base_url, PROMPTS, **body)]
    want = [complete(single.base_url, p, **body)["choices"][0]["text"] for p in PROMPTS]
    assert got == want


def test_a_disconnect_frees_its_engines_requests(servers):
    dp, *_ = servers
    aborted = per_engine(dp.base_url, "pagellm:request_success_total", finished_reason="abort")
    clients, streams, lines = [], [], []
    for _ in range(2):  # one per engine: the second goes to the engine without the first
        c = httpx.Client(base_url=dp.base_url, timeout=120)
        s = c.stream("POST", "/v1/completions", json={
            "prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "stream": True})
        resp = s.__enter__()
        assert resp.status_code == 200
        lines.append(resp.iter_lines())  # kept: dropping it would close the stream
        first = next(lines[-1])  # the first chunk: running
        assert '"finish_reason":null' in first, first
        clients.append(c)
        streams.append(s)
    running = per_engine(dp.base_url, "pagellm:num_requests_running")
    load = httpx.get(f"{dp.base_url}/get_load").json()["load"]
    for s, c in zip(streams, clients, strict=True):
        s.__exit__(None, None, None)
        c.close()
    assert running == (1, 1) and load == 2  # /get_load: the engines' sum

    def freed() -> bool:
        m = scrape(dp.base_url)
        return all(metric(m, name, engine=str(e)) == 0 for e in (0, 1) for name in (
            "pagellm:num_requests_running", "pagellm:num_requests_waiting",
            "pagellm:kv_cache_usage_perc"))

    assert wait_until(freed, timeout_s=30)
    after = per_engine(dp.base_url, "pagellm:request_success_total", finished_reason="abort")
    assert [a - b for a, b in zip(after, aborted, strict=True)] == [1, 1]


def test_a_prefix_cache_reset_reaches_both_engines(servers):
    dp, *_ = servers
    prompt = " ".join(["alpha beta gamma delta"] * 12)  # several full KV blocks
    together(dp.base_url, [prompt, prompt], **LONG)  # one copy cached on each engine
    hits0 = per_engine(dp.base_url, "pagellm:prefix_cache_hits_total")
    together(dp.base_url, [prompt, prompt], **LONG)
    hits1 = per_engine(dp.base_url, "pagellm:prefix_cache_hits_total")
    assert all(b > a for a, b in zip(hits0, hits1, strict=True)), (hits0, hits1)
    r = httpx.post(f"{dp.base_url}/reset_prefix_cache", timeout=60)
    assert r.status_code == 200 and r.json() == {"success": True}
    together(dp.base_url, [prompt, prompt], **LONG)
    assert per_engine(dp.base_url, "pagellm:prefix_cache_hits_total") == hits1  # none left


def test_external_load_balancing_runs_one_rank_per_server(servers):
    for rank, srv in enumerate(servers[1:]):
        before = scrape(srv.base_url)
        complete(srv.base_url, "hello", max_tokens=4)
        m = scrape(srv.base_url)
        done = metric(m, "vllm:request_success_total", engine=str(rank)) - \
            metric(before, "vllm:request_success_total", engine=str(rank))
        assert done == 1
        assert metric(m, "vllm:request_success_total", engine=str(1 - rank)) == 0
        assert len(re.findall(r"Engine core process started", srv.log())) == 1
        assert f"Data-parallel rank {rank} of 2 (external load balancing)" in srv.log()


def test_killing_one_engine_fails_health_and_stops_the_server(servers):
    dp, *_ = servers  # last: this server does not come back
    pids = engine_pids(dp)
    os.kill(pids[1], signal.SIGKILL)
    assert wait_until(lambda: _health(dp.base_url) != 200, timeout_s=30)
    assert dp.proc.wait(60) == 1
    assert wait_until(lambda: not pid_alive(pids[0]), timeout_s=30)  # no orphan engine
    assert "The engine core process of data-parallel rank 1 exited" in dp.log()


def _health(base_url: str) -> int:
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0  # the server already stopped
