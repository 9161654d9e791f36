"""How fast the packed CPU linear (``cpu_ops.linear_packed``) streams its weight, against the
machine's read bandwidth (``pagellm bench latency``'s floor: summing a 512 MiB float32 tensor).

For each weight shape, dtype and row count it times the product on ``linear_pack``'s copy (on
2 MiB pages where the system grants them, kernels/huge_pages.py) and on the same packed bytes
in a plain ``torch.empty`` (4 KiB pages), alternating, and prints the median time, GB/s of
weight read, its share of the read bandwidth and GFLOP/s. Run it on an idle machine.

    .venv/bin/python benchmarks/linear_stream.py
    .venv/bin/python benchmarks/linear_stream.py --shapes 2048x128256 --rows 1,2 --dtypes float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagellm.benchmarks.latency import measure_read_bandwidth
from pagellm.kernels import cpu_ops

# [K, N]: Llama-3.2-1B's tied LM head and MLP, Qwen2.5-0.5B's LM head and MLP.
DEFAULT_SHAPES = "2048x128256,2048x16384,8192x2048,896x151936,896x9728"


def seconds_per_call(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="KxN weight shapes, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,16,32,256", help="rows of x (M), comma-separated")
    p.add_argument("--dtypes", default="bfloat16,float32", help="bfloat16 and/or float32")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    bandwidth = measure_read_bandwidth("cpu", 512) / 1e9
    print(f"read bandwidth (sum of 512 MiB): {bandwidth:.1f} GB/s, {torch.get_num_threads()} "
          "threads")
    for dtype_name in ns.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        if not cpu_ops.linear_packed_supports(torch.empty(16, 32, dtype=dtype)):
            print(f"{dtype_name}: no packed linear kernel on this CPU")
            continue
        for shape in ns.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            huge = cpu_ops.linear_pack(torch.randn(n, k).to(dtype))
            small = torch.empty(huge.shape, dtype=dtype)  # 4 KiB pages (THP mode madvise)
            small.copy_(huge)
            nbytes = huge.numel() * huge.element_size()
            for m in (int(v) for v in ns.rows.split(",")):
                x = torch.randn(m, k).to(dtype)
                calls = max(1, int(1e9 / nbytes / max(1, m / 16)))
                pages = {"2MiB": huge, "4KiB": small}
                for packed in pages.values():  # warm up
                    cpu_ops.linear_packed(x, packed, None)
                times: dict[str, list[float]] = {name: [] for name in pages}
                for _ in range(ns.repeats):  # alternate, as the machine drifts
                    for name, packed in pages.items():
                        times[name].append(seconds_per_call(
                            lambda x=x, packed=packed: cpu_ops.linear_packed(x, packed, None),
                            calls))
                parts = []
                for name, ts in times.items():
                    t = statistics.median(ts)
                    gbs = nbytes / t / 1e9
                    parts.append(f"{name} {t * 1e3:8.3f} ms {gbs:5.1f} GB/s "
                                 f"({100 * gbs / bandwidth:3.0f}%) "
                                 f"{2 * m * n * k / t / 1e9:6.1f} GFLOP/s")
                print(f"{dtype_name} K={k} N={n} M={m}: " + "  ".join(parts), flush=True)


if __name__ == "__main__":
    main()
