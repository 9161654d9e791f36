"""``pagellm bench serve`` against a fake streaming server whose delays are known."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_utils import free_port

from pagellm.benchmarks.serve import (
    RequestResult,
    add_bench_serve_parser,
    arrival_intervals,
    bench_serve,
    load_dataset,
    parse_rates,
    summarize,
)
from pagellm.benchmarks.serve_stats import judge_sustained

FIRST_TOKEN_S = 0.05
TOKEN_GAP_S = 0.02


def make_fake_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["bodies"].append(body)
        if body["prompt"] == "fail":
            return JSONResponse({"error": {"message": "bad prompt"}}, status_code=400)
        n_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else 3

        async def gen():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                await asyncio.sleep(FIRST_TOKEN_S)
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(TOKEN_GAP_S)
                    chunk = {"choices": [{"index": 0, "text": f" t{i}"}], "usage": None}
                    yield f"data: {json.dumps(chunk)}\n\n"
                usage = {"prompt_tokens": n_prompt, "completion_tokens": body["max_tokens"],
                         "total_tokens": n_prompt + body["max_tokens"]}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    state = {"bodies": [], "in_flight": 0, "max_in_flight": 0}
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_fake_app(state), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(10)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["serve", *argv])


def test_bench_measures_known_delays(fake_server, tmp_path, capsys):
    base_url, state = fake_server
    state["max_in_flight"] = 0
    dataset = tmp_path / "data.jsonl"
    rows = [{"prompt_token_ids": [1, 2, 3, 4], "max_tokens": 5},
            {"prompt": "hello there", "max_tokens": 5}]
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out_json = tmp_path / "result.json"
    summary = bench_serve(parse(["--base-url", base_url, "--dataset", str(dataset),
                                     "--num-prompts", "6", "--max-concurrency", "2",
                                     "--ignore-eos", "--output-json", str(out_json)]))
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["model"] == "fake-model"
    assert summary["total_output_tokens"] == 30
    assert summary["total_input_tokens"] == 3 * 4 + 3 * 3
    assert state["max_in_flight"] == 2
    sent = state["bodies"][-6:]
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"]["include_usage"]
               for b in sent)
    assert sorted(json.dumps(b["prompt"]) for b in sent) == sorted(
        [json.dumps([1, 2, 3, 4])] * 3 + [json.dumps("hello there")] * 3)
    # Lower bounds are exact (the fake server sleeps); upper bounds only guard against nonsense.
    assert FIRST_TOKEN_S * 1000 <= summary["ttft_ms"]["mean"] < FIRST_TOKEN_S * 1000 + 2000
    assert TOKEN_GAP_S * 1000 * 0.9 <= summary["itl_ms"]["median"] < TOKEN_GAP_S * 1000 + 500
    assert TOKEN_GAP_S * 1000 * 0.9 <= summary["tpot_ms"]["mean"] < TOKEN_GAP_S * 1000 + 500
    e2e_floor = (FIRST_TOKEN_S + 4 * TOKEN_GAP_S) * 1000
    assert e2e_floor <= summary["e2e_latency_ms"]["median"]
    # Three rounds of two concurrent requests, each at least e2e_floor long.
    assert summary["duration_s"] >= 3 * e2e_floor / 1000
    assert json.loads(out_json.read_text())["total_output_tokens"] == 30
    text = capsys.readouterr().out
    assert "Mean TTFT (ms):" in text and "P99 ITL (ms):" in text and "Successful requests:" in text


def test_bench_counts_failures(fake_server, tmp_path):
    base_url, _ = fake_server
    dataset = tmp_path / "data.jsonl"
    dataset.write_text(json.dumps({"prompt": "fail", "max_tokens": 2}) + "\n"
                       + json.dumps({"prompt": "ok", "max_tokens": 2}) + "\n")
    summary = bench_serve(parse(["--base-url", base_url, "--dataset", str(dataset),
                                     "--num-prompts", "4", "--request-rate", "50"]))
    assert summary["completed"] == 2 and summary["failed"] == 2
    assert any("HTTP 400" in e for e in summary["errors"])


def test_random_dataset_and_poisson_arrivals():
    reqs = load_dataset("random", 20, 16, 8, 1000, 0.5, seed=1)
    assert len(reqs) == 20
    assert all(8 <= len(r.prompt) <= 24 and 4 <= r.max_tokens <= 12 for r in reqs)
    assert all(0 <= t < 1000 for r in reqs for t in r.prompt)
    assert load_dataset("random", 20, 16, 8, 1000, 0.5, seed=1)[0].prompt == reqs[0].prompt
    gaps = arrival_intervals(4001, 4.0, seed=0)
    assert gaps[0] == 0.0 and len(gaps) == 4001
    assert abs(np.mean(gaps[1:]) - 0.25) < 0.025  # exponential, mean 1/rate
    assert abs(np.std(gaps[1:]) - 0.25) < 0.025  # and std 1/rate
    assert arrival_intervals(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_summary_statistics():
    results = [RequestResult(success=True, ttft=0.001 * (i + 1), e2e=0.1 + 0.001 * i,
                             itls=[0.01], num_prompt_tokens=10, num_output_tokens=11)
               for i in range(100)]
    results.append(RequestResult(success=False, error="boom"))
    s = summarize(results, duration=2.0)
    assert s["completed"] == 100 and s["failed"] == 1 and s["errors"] == ["boom"]
    assert s["request_throughput"] == 50.0
    assert s["output_throughput"] == 550.0 and s["total_token_throughput"] == 1050.0
    # TTFTs are 1..100 ms: mean 50.5, linear-interpolated p90 = 90.1, p99 = 99.01.
    assert s["ttft_ms"]["mean"] == pytest.approx(50.5)
    assert s["ttft_ms"]["median"] == pytest.approx(50.5)
    assert s["ttft_ms"]["p90"] == pytest.approx(90.1)
    assert s["ttft_ms"]["p99"] == pytest.approx(99.01)
    # TPOT = (e2e - ttft) / 10 = (100 + i - (i + 1)) ms / 10 = 9.9 ms for every request.
    assert s["tpot_ms"]["p99"] == pytest.approx(9.9)
    assert s["itl_ms"]["mean"] == pytest.approx(10.0)


def test_random_range_ratio_spans_the_range():
    """256 +- 128 prompts and 128 +- 64 outputs, as `--random-range-ratio 0.5` promises."""
    reqs = load_dataset("random", 400, 256, 128, 1000, 0.5, seed=3)
    ins = [len(r.prompt) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert 128 <= min(ins) < 140 and 372 < max(ins) <= 384
    assert 64 <= min(outs) < 70 and 186 < max(outs) <= 192
    assert all(r.num_prompt_tokens == len(r.prompt) for r in reqs)


def test_flag_errors():
    with pytest.raises(ValueError, match="--random-range-ratio"):
        bench_serve(parse(["--random-range-ratio", "1.0"]))
    with pytest.raises(ValueError, match="--plot-only"):
        bench_serve(parse(["--plot-only", "--plot", "x.png"]))
    with pytest.raises(SystemExit):
        parse(["--request-rate", "2,0"])
    assert parse_rates("2, 4,inf") == [2.0, 4.0, float("inf")]


def _steady(n: int, gap: float, ttft, e2e, fail: int = -1) -> tuple[list[RequestResult], float]:
    """Synthetic results: one arrival every ``gap`` s; duration = last answer."""
    results = [RequestResult(success=i != fail, ttft=ttft(i), e2e=e2e(i), arrival=i * gap,
                             num_output_tokens=10) for i in range(n)]
    return results, max(r.arrival + r.e2e for r in results)


def test_sustained_verdicts():
    # Keeps up: constant latency, answers as spread as arrivals.
    results, duration = _steady(30, 0.1, lambda i: 0.05, lambda i: 0.5)
    tput = summarize(results, duration)["request_throughput"]
    v = judge_sustained(results, 10.0, tput)
    assert v["sustained"] is True
    assert v["offered_rate_with_tail"] == pytest.approx(30 / (2.9 + 0.5))
    assert v["throughput_ratio"] == pytest.approx(1.0)
    assert v["offered_rate_realized"] == pytest.approx(10.0)
    # A backlog: each request waits 0.2 s longer than the one before.
    results, duration = _steady(30, 0.1, lambda i: 0.05 + 0.2 * i, lambda i: 0.5 + 0.2 * i)
    v = judge_sustained(results, 10.0, summarize(results, duration)["request_throughput"])
    assert v["sustained"] is False and v["throughput_ratio"] < 0.9
    assert v["ttft_median_last_third_ms"] > 2 * v["ttft_median_first_third_ms"]
    # TTFT growth alone (throughput fine) is enough to fail; small absolute growth is not.
    results, duration = _steady(30, 0.1, lambda i: 0.05 + 0.02 * i, lambda i: 0.5)
    assert judge_sustained(results, 10.0, tput)["sustained"] is False
    results, duration = _steady(30, 0.1, lambda i: 0.01 + 0.001 * i, lambda i: 0.5)
    assert judge_sustained(results, 10.0, tput)["sustained"] is True
    # Every stream slowing down (TPOT over the SLO) fails the rate even with no queue: how an
    # overloaded continuous-batching server that admits every request shows it.
    results, duration = _steady(30, 0.1, lambda i: 0.05, lambda i: 0.05 + 9 * 0.25)
    v = judge_sustained(results, 10.0, summarize(results, duration)["request_throughput"])
    assert v["sustained"] is False and v["tpot_p99_ms"] == pytest.approx(250.0)
    assert judge_sustained(results, 10.0, summarize(results, duration)["request_throughput"],
                           slo_tpot_s=0.3)["sustained"] is True
    results, duration = _steady(30, 0.1, lambda i: 2.5, lambda i: 3.0)
    assert judge_sustained(results, 10.0, summarize(results, duration)["request_throughput"]
                           )["sustained"] is False  # p99 TTFT over 2 s
    # One failure fails the rate; inf and tiny runs are not judged.
    results, duration = _steady(30, 0.1, lambda i: 0.05, lambda i: 0.5, fail=7)
    assert judge_sustained(results, 10.0, tput)["sustained"] is False
    assert judge_sustained(results, float("inf"), tput) == {"sustained": None}
    assert judge_sustained(results[:2], 10.0, tput) == {"sustained": None}


def _lines(ax) -> dict[str, list[float]]:
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_sweep_json_and_plot(fake_server, tmp_path, capsys):
    from pagellm.benchmarks.serve_plot import build_figure  # matplotlib: in the test extra

    base_url, state = fake_server
    sweep_path, png = tmp_path / "a.json", tmp_path / "a.png"
    n_before = len(state["bodies"])
    sweep = bench_serve(parse([
        "--base-url", base_url, "--num-prompts", "4", "--random-input-len", "8",
        "--random-output-len", "4", "--random-range-ratio", "0.5", "--request-rate", "40,80",
        "--request-rate", "160", "--num-warmups", "1", "--ignore-eos", "--label", "fake-A",
        "--output-json", str(sweep_path), "--plot", str(png)]))
    # 3 rates x 4 prompts + one warm-up request per rate.
    assert len(state["bodies"]) - n_before == 3 * 5
    saved = json.loads(sweep_path.read_text())
    assert saved["label"] == "fake-A" and saved["model"] == "fake-model"
    assert [r["request_rate"] for r in saved["runs"]] == [40.0, 80.0, 160.0]
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in saved["runs"])
    assert all(isinstance(r["sustained"], bool) for r in saved["runs"])
    sustained = [r["request_rate"] for r in saved["runs"] if r["sustained"]]
    assert saved["max_sustained_rate"] == (max(sustained) if sustained else None)
    assert saved["config"]["random_range_ratio"] == 0.5 and saved["sustained_definition"]
    # Each rate's prompts differ (no prefix-cache reuse across rates) but are seeded.
    prompts = [json.dumps(b["prompt"]) for b in state["bodies"][n_before:]]
    assert len(set(prompts)) > 4
    assert sweep["runs"][1]["ttft_ms"] == saved["runs"][1]["ttft_ms"]
    assert "Highest sustained rate:" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A second server's sweep on the same figure: its lines carry its label and its figures.
    other = dict(saved, label="fake-B", runs=[dict(r, ttft_ms=dict(r["ttft_ms"], median=7.0))
                                              for r in saved["runs"]])
    other_path = tmp_path / "b.json"
    other_path.write_text(json.dumps(other))
    both = tmp_path / "both.png"
    assert bench_serve(parse(["--plot-only", "--plot", str(both), "--plot-compare",
                              str(sweep_path), str(other_path)])) == {}
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = build_figure([saved, other])
    ttft, tpot, e2e, tput = fig.axes[:4]
    lines = _lines(ttft)
    assert lines["fake-A p50"] == [r["ttft_ms"]["median"] for r in saved["runs"]]
    assert lines["fake-A p99"] == [r["ttft_ms"]["p99"] for r in saved["runs"]]
    assert lines["fake-B p50"] == [7.0, 7.0, 7.0]
    assert _lines(tpot)["fake-B p99"] == [r["tpot_ms"]["p99"] for r in saved["runs"]]
    assert _lines(e2e)["fake-A p50"] == [r["e2e_latency_ms"]["median"] for r in saved["runs"]]
    assert _lines(tput)["fake-A achieved"] == [r["request_throughput"] for r in saved["runs"]]
    assert list(ttft.get_lines()[0].get_xdata()) == [40.0, 80.0, 160.0]
