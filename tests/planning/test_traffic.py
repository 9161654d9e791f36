"""--from-log / --from-metrics: recommendations from a synthetic length distribution, against a
hand computation, through the real CLI (a real Prometheus exposition served on 127.0.0.1)."""

from __future__ import annotations

import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from pagellm.entrypoints.cli import main
from pagellm.planning.recommend import Histogram, advise_from_histograms, advise_from_lengths
from pagellm.planning.traffic import parse_metrics_text, read_length_log

# 200 requests: (prompt, output, how many). Totals: 150 x 120, 45 x 400, 3 x 1000, 2 x 4000.
SYNTHETIC = [(100, 20, 150), (300, 100, 45), (900, 100, 3), (3000, 1000, 2)]
CPU_FLAGS = ["--device", "cpu", "--kv-cache-memory", "256MiB", "--max-model-len", "2048"]


def _requests() -> list[tuple[int, int]]:
    return [(p, o) for p, o, n in SYNTHETIC for _ in range(n)]


def test_advice_from_exact_lengths_by_hand():
    advice = advise_from_lengths([p + o for p, o in _requests()], 0.99, 16, 8192, 1000)
    # Nearest rank: the 198th of 200 sorted totals is 1000; rounded up to a block: 1008.
    assert advice.quantile_len == 1000 and advice.max_model_len == 1008
    assert advice.rejected_share == 2 / 200 and not advice.rejected_is_bound
    # Admitted: 150 x 8 blocks + 45 x 25 + 3 x 63 = 2514 blocks over 198 requests.
    assert advice.mean_blocks == pytest.approx(2514 / 198)
    assert advice.max_num_seqs == math.floor(1000 * 198 / 2514) == 78
    assert advice.mean_len == pytest.approx((150 * 120 + 45 * 400 + 3 * 1000 + 2 * 4000) / 200)
    # Capped at the model's context.
    capped = advise_from_lengths([5000] * 10, 0.99, 16, 4096, 1000)
    assert capped.max_model_len == 4096 and capped.capped_by_context
    assert capped.rejected_share == 1.0


def _histogram(values: list[int], bounds: list[float]) -> Histogram:
    buckets = tuple((b, float(sum(v <= b for v in values))) for b in [*bounds, math.inf])
    return Histogram(buckets, float(len(values)), float(sum(values)))


def test_advice_from_histograms_by_hand():
    prompts = [p for p, _ in _requests()]
    outputs = [o for _, o in _requests()]
    prompt = _histogram(prompts, [100, 500, 1000, 5000])
    output = _histogram(outputs, [20, 100, 1000])
    advice = advise_from_histograms(prompt, output, 0.98, 16, 32768, 1000)
    # Each marginal at 0.99 (198 of 200): prompt <= 1000, output <= 100 -> 1100 -> 1104.
    assert advice.quantile_len == 1100 and advice.max_model_len == 1104
    # Best union bound at 1104: P(prompt > 1000) + P(output > 100) = 0.01 + 0.01.
    assert advice.rejected_share == pytest.approx(0.02) and advice.rejected_is_bound
    assert advice.mean_len == pytest.approx(37200 / 200 + 9800 / 200)  # 235
    assert advice.mean_blocks == pytest.approx(235 / 16 + 0.5)
    assert advice.max_num_seqs == math.floor(1000 / (235 / 16 + 0.5)) == 65


@pytest.mark.parametrize("seed", range(5))
def test_histogram_bound_holds_on_random_traffic(seed):
    rng = random.Random(seed)
    pairs = [(int(rng.lognormvariate(6, 1)), int(rng.lognormvariate(4, 1.2))) for _ in range(500)]
    bounds = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000]
    advice = advise_from_histograms(_histogram([p for p, _ in pairs], bounds),
                                    _histogram([o for _, o in pairs], bounds), 0.99, 16, 10**6, 10)
    true_share = sum(p + o > advice.max_model_len for p, o in pairs) / len(pairs)
    assert true_share <= advice.rejected_share <= 0.01 + 1e-12


def test_read_length_log_formats(tmp_path):
    log = tmp_path / "lengths.log"
    log.write_text('# a comment\n{"prompt_tokens": 5, "output_tokens": 7}\n\n'
                   '{"prompt_tokens": 1, "completion_tokens": 2, "model": "x"}\n'
                   "12:00:01 req-9 output_tokens=4 prompt_tokens=3 status=ok\n")
    assert read_length_log(str(log)) == [(5, 7), (1, 2), (3, 4)]
    log.write_text('{"prompt_tokens": 5}\n')
    with pytest.raises(ValueError, match=r"lengths.log:1: need non-negative integer"):
        read_length_log(str(log))


def _metrics_text(label_sets: int = 1, prefix: str = "pagellm") -> str:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    reg = CollectorRegistry()
    prompt = Histogram(f"{prefix}:request_prompt_tokens", "p", ["model_name"],
                       buckets=[100, 500, 1000, 5000], registry=reg)
    output = Histogram(f"{prefix}:request_generation_tokens", "o", ["model_name"],
                       buckets=[20, 100, 1000], registry=reg)
    for i, (p, o) in enumerate(_requests()):
        prompt.labels(f"m{i % label_sets}").observe(p)
        output.labels(f"m{i % label_sets}").observe(o)
    return generate_latest(reg).decode()


def test_parse_metrics_sums_label_sets_and_reads_vllm_names():
    one = parse_metrics_text(_metrics_text(1))
    assert parse_metrics_text(_metrics_text(3)) == one
    assert parse_metrics_text(_metrics_text(1, "vllm")) == one
    hist = one["request_prompt_tokens"]
    assert hist.count == 200 and hist.sum == 37200
    assert hist.buckets == ((100.0, 150.0), (500.0, 195.0), (1000.0, 198.0), (5000.0, 200.0),
                            (math.inf, 200.0))


@pytest.fixture
def metrics_server():
    body = _metrics_text(2).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 200 if self.path == "/metrics" else 404
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if status == 200 else b"")

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_cli_from_metrics_and_from_log_agree_with_the_plan(metrics_server, tmp_path, capsys):
    assert main(["plan", *CPU_FLAGS, "--json", "--quantile", "0.98",
                 "--from-metrics", metrics_server]) == 0
    out = json.loads(capsys.readouterr().out)
    blocks = out["ranks"][0]["num_blocks"]
    traffic = out["traffic"]
    assert traffic["num_blocks"] == blocks
    assert traffic["max_model_len"] == 1104 and traffic["rejected_share"] == pytest.approx(0.02)
    assert traffic["max_num_seqs"] == math.floor(blocks / (235 / 16 + 0.5))

    log = tmp_path / "requests.jsonl"
    log.write_text("".join(json.dumps({"prompt_tokens": p, "output_tokens": o}) + "\n"
                           for p, o in _requests()))
    assert main(["plan", *CPU_FLAGS, "--from-log", str(log)]) == 0
    text = capsys.readouterr().out
    assert "--max-model-len 1008: p99 (prompt + output) = 1,000 tokens" in text
    assert "reject 1.00% of these requests" in text
    assert f"--max-num-seqs {math.floor(blocks * 198 / 2514)}:" in text


def test_cli_from_metrics_unreachable(capsys):
    assert main(["plan", *CPU_FLAGS, "--from-metrics", "http://127.0.0.1:9/metrics"]) == 2
    assert "--from-metrics http://127.0.0.1:9/metrics: cannot read" in capsys.readouterr().err
