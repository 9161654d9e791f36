"""``--async-scheduling`` against the synchronous engine, side by side: ``pagellm bench
latency`` at each batch size and ``pagellm bench throughput``, each run with and without the
flag, alternating (the order flipped every repeat, as the machine drifts), in fresh processes.
Prints the median of each side and the async/sync ratio (below 1: async is faster).

    .venv/bin/python benchmarks/async_scheduling.py --dtype bfloat16 --batch-sizes 1,64
    .venv/bin/python benchmarks/async_scheduling.py --repeats 3 -- --max-num-seqs 64

Arguments after ``--`` go to every ``pagellm bench`` command (engine flags: model, dtype,
KV cache size, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CLI = [sys.executable, "-m", "pagellm.entrypoints.cli", "bench"]


def bench(kind: str, args: list[str], overlapped: bool) -> dict:
    """One ``pagellm bench <kind>`` run in its own process; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [*CLI, kind, *args, "--output-json", str(out)]
        if overlapped:
            cmd.append("--async-scheduling")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


METRICS = {
    "batch latency (s)": lambda r: r["avg_latency_s"],
    "decode per token (ms)": lambda r: (r["decode_ms_per_step"] or {}).get("avg", 0.0),
    "output tokens/s": lambda r: r["output_tokens_per_s"],
}


def side_by_side(kind: str, args: list[str], metrics: list[str], repeats: int) -> list[dict]:
    """Each metric's median over ``repeats`` pairs of runs (the order flipped each pair), with
    and without the flag, and their ratio."""
    results: dict[bool, list[dict]] = {False: [], True: []}
    for i in range(repeats):
        for overlapped in ((False, True) if i % 2 == 0 else (True, False)):
            results[overlapped].append(bench(kind, args, overlapped))
    rows = []
    for metric in metrics:
        runs = {side: [METRICS[metric](r) for r in rs] for side, rs in results.items()}
        sync, over = statistics.median(runs[False]), statistics.median(runs[True])
        rows.append({"metric": metric, "sync": sync, "async": over,
                     "ratio": over / sync if sync else float("nan"),
                     "sync_runs": runs[False], "async_runs": runs[True]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,64", help="bench latency batch sizes")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=64, help="bench throughput requests")
    p.add_argument("--repeats", type=int, default=2, help="pairs of runs per measurement")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--output-json", default=None)
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="after --: flags for every pagellm bench command")
    ns = p.parse_args(argv)
    extra = [a for a in ns.engine_args if a != "--"]
    rows = []
    for bs in (int(b) for b in ns.batch_sizes.split(",") if b):
        args = ["--batch-size", str(bs), "--input-len", str(ns.input_len), "--output-len",
                str(ns.output_len), "--num-iters", str(ns.num_iters), "--num-iters-warmup",
                "1", "--bandwidth-mib", "0", *extra]
        if bs > 1 and not any(a == "--max-num-seqs" for a in extra):
            args += ["--max-num-seqs", str(bs)]
        rows += [{"bench": f"latency batch {bs}", **r} for r in side_by_side(
            "latency", args, ["batch latency (s)", "decode per token (ms)"], ns.repeats)]
    if not ns.skip_throughput:
        args = ["--num-prompts", str(ns.num_prompts), "--input-len", str(ns.input_len),
                "--output-len", str(ns.output_len), *extra]
        rows += [{"bench": "throughput", **r} for r in side_by_side(
            "throughput", args, ["output tokens/s"], ns.repeats)]
    print(f"{'bench':<20}{'metric':<24}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for r in rows:
        print(f"{r['bench']:<20}{r['metric']:<24}{r['sync']:>10.3f}{r['async']:>10.3f}"
              f"{r['ratio']:>12.3f}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
