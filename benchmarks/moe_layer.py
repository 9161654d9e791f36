"""One MoE layer on the CPU: the fused kernel (kernels/cpu_moe.cpp) against FusedMoE's torch
path, and against the floor the expert bytes it reads set (at the machine's measured read speed).

    .venv/bin/python benchmarks/moe_layer.py                     # Qwen3-30B-A3B's layer shape
    .venv/bin/python benchmarks/moe_layer.py --experts 8 --top-k 2 --hidden 1024 --inter 1024

Random weights and routing logits; per token count the median of ``--repeats`` calls. "touched"
is the share of experts that get a row (decode reads only those); "GB/s" is the bytes of the
experts touched divided by the kernel's time. Check that /proc/loadavg is below 0.5 first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _read_speed_gbs(nbytes: int = 1 << 30) -> float:
    """Memory read speed: a float32 sum over a buffer far larger than the caches."""
    buf = torch.ones(nbytes // 4)
    return nbytes / _median_s(lambda: buf.sum(), 5) / 1e9


def main() -> None:
    from pagellm.kernels import cpu_moe
    from pagellm.layers.fused_moe import FusedMoE, route

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", default="1,4,32,128,512")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=10)
    ns = ap.parse_args()
    dtype = getattr(torch, ns.dtype)
    with open("/proc/loadavg") as f:
        print(f"load average: {f.read().split()[0]}")
    e, k, h, i = ns.experts, ns.top_k, ns.hidden, ns.inter
    moe = FusedMoE(e, k, h, i, renormalize=True, params_dtype=dtype)
    moe.w13_weight.data.normal_(0, h ** -0.5)
    moe.w2_weight.data.normal_(0, i ** -0.5)
    if not cpu_moe.supports(dtype, h, i):
        raise SystemExit("the fused kernel does not take this shape or dtype here")
    p13, p2 = cpu_moe.pack_experts(moe.w13_weight.data, moe.w2_weight.data)
    expert_bytes = 3 * h * i * dtype.itemsize
    speed = _read_speed_gbs()
    print(f"memory read speed {speed:.1f} GB/s; {e} experts of {expert_bytes / 2**20:.1f} MiB, "
          f"top-{k}, hidden {h}, width {i}, {ns.dtype}")
    print(f"{'tokens':>6} {'touched':>8} {'torch ms':>9} {'fused ms':>9} {'speedup':>8} "
          f"{'GB/s':>6} {'floor ms':>9}")
    g = torch.Generator().manual_seed(0)
    for t in map(int, ns.tokens.split(",")):
        x = torch.randn(t, h, generator=g).to(dtype)
        weights, ids = route(torch.randn(t, e, generator=g), k, True, dtype)
        touched = ids.unique().numel()
        args = (x, weights, ids)
        torch_s = _median_s(lambda a=args: moe._forward_grouped(*a), ns.repeats)
        fused_s = _median_s(lambda a=args: cpu_moe.moe_forward(*a, p13, p2, i), ns.repeats)
        read = touched * expert_bytes
        print(f"{t:>6} {touched / e:>8.0%} {torch_s * 1e3:>9.2f} {fused_s * 1e3:>9.2f} "
              f"{torch_s / fused_s:>7.2f}x {read / fused_s / 1e9:>6.1f} "
              f"{read / speed / 1e6:>9.2f}")


if __name__ == "__main__":
    main()
