"""The CPU's arithmetic peak, the ceiling of every compute-bound figure (an offline run, a
prefill, the packed GEMM of ``linear_stream.py``): a loop of 24 independent AVX-512 dot
products (bfloat16 ``vdpbf16ps``, 64 flops each) or FMAs (float32, 32 flops each) on registers
only, on every core at once, compiled with the machine's C++ compiler like the kernels
(``-march=native``). Prints GFLOP/s per thread and their sum. Run it on an idle machine.

    .venv/bin/python benchmarks/cpu_peak.py
    .venv/bin/python benchmarks/cpu_peak.py --threads 1 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const long iters = atol(argv[1]);
#pragma omp parallel
  {
    __m512 acc[24];
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
    __m512 a = _mm512_set1_ps(1e-9f), b = _mm512_set1_ps(1e-9f);
    auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) acc[i] = MADD(acc[i], a, b);
      asm volatile("" : "+v"(a));  // keeps the loop from being folded
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float sink = 0;
    for (int i = 0; i < 24; ++i) sink += _mm512_reduce_add_ps(acc[i]);
#pragma omp critical
    printf("%d %.3f %g\n", omp_get_thread_num(), iters * 24.0 * FLOPS / s / 1e9, sink);
  }
}
"""
# One instruction of each dtype: its expression and flops.
KINDS = {"bfloat16": ("_mm512_dpbf16_ps(c, (__m512bh)(x), (__m512bh)(y))", 64),
         "float32": ("_mm512_fmadd_ps(x, y, c)", 32)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(KINDS), default="bfloat16")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--giga-instructions", type=float, default=0.2,
                   help="instructions per thread, in billions (default 0.2: about a second)")
    ns = p.parse_args()
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SystemExit("no C++ compiler on PATH (c++ or g++)")
    expr, flops = KINDS[ns.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        build = subprocess.run([compiler, "-O2", "-march=native", "-fopenmp",
                                f"-DFLOPS={flops}", f"-DMADD(c,x,y)={expr}", str(src), "-o",
                                str(exe)], capture_output=True, text=True)
        if build.returncode != 0:
            raise SystemExit(f"cannot build the {ns.dtype} loop here (this CPU needs AVX-512"
                             f"{' with AVX512-BF16' if ns.dtype == 'bfloat16' else ''}):\n"
                             f"{build.stderr[-2000:]}")
        iters = str(int(ns.giga_instructions * 1e9 / 24))
        out = subprocess.run([str(exe), iters], check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(ns.threads)}).stdout
    rates = sorted((int(t), float(r)) for t, r, _ in (line.split() for line in out.splitlines()))
    for t, r in rates:
        print(f"thread {t}: {r:.1f} GFLOP/s")
    print(f"{ns.dtype} peak, {len(rates)} threads: {sum(r for _, r in rates):.1f} GFLOP/s")


if __name__ == "__main__":
    main()
