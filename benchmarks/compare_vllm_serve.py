"""Online comparison: ``pagellm serve`` and vLLM-CPU's OpenAI server at the same request rates.

usage: python benchmarks/compare_vllm_serve.py [--rates 2,4,8] [--num-prompts 100]
       [--input-len 256] [--output-len 128] [--range-ratio 0.5] [--dtype bfloat16]
       [--out-dir DIR] [--skip-vllm | --skip-pagellm] [--vllm-python PATH] [--hf-dir DIR]
       [--model-config DIR] [--vllm-arg=--flag ...] [pagellm serve flags...]

One after the other, never together: start ``pagellm serve`` (default model), run the sweep with
``pagellm bench serve`` (Poisson arrivals at each rate, random-token prompts of input-len +-
range-ratio, outputs likewise, greedy, ignore_eos, streaming), stop it; then the same for vLLM's
CPU build (its own venv, the settings of ../shared/PEERS.md for this 2-core machine), with the
same client, prompts and seeds. Writes DIR/pagellm.json, DIR/vllm.json, DIR/sweep.png (both
servers on one figure) and DIR/compare.json, and prints the ratios (pagellm / vLLM: below 1 is
pagellm faster). Start-up is not timed. Check /proc/loadavg < 0.5 first; any other busy process
makes the figures meaningless. Unknown flags go to ``pagellm serve``.

``--model-config DIR`` (a folder with only a config.json, e.g. benchmarks/model_configs/*) serves
that model's shapes with random weights on both servers (``--load-format dummy``), with the
default model's tokenizer (``--hf-dir``'s): the random prompts' token ids fit any larger vocabulary.

``--repeats N`` (N >= 2) interleaves instead, for machines whose speed drifts between minutes:
both servers are started (an idle server takes next to no CPU while the other runs), then every
rate is run N times per server, alternating which goes first; each reported percentile is the
median over the N runs, and the ratios of each back-to-back pair are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pagellm.entrypoints.ports import free_port

REPO = Path(__file__).resolve().parents[1]


class Server:
    """A server subprocess in its own process group (vLLM spawns engine processes), logging to
    a file, ready once /health answers 200."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None,
                 timeout_s: float = 900.0) -> None:
        self.name, self.log_path = name, log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        print(f"[{name}] starting: {' '.join(cmd)}  (log: {log})", flush=True)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.startup_s = self._wait_healthy(cmd, timeout_s)
        print(f"[{name}] ready in {self.startup_s:.1f} s", flush=True)

    def _wait_healthy(self, cmd: list[str], timeout_s: float) -> float:
        port = cmd[cmd.index("--port") + 1]
        self.base_url = f"http://127.0.0.1:{port}"
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                self._log.close()
                tail = self.log_path.read_text()[-3000:]
                raise SystemExit(f"[{self.name}] exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise SystemExit(f"[{self.name}] not healthy after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        print(f"[{self.name}] stopped", flush=True)


def run_sweep(ns: argparse.Namespace, server: Server, label: str, out_json: Path,
              extra: list[str]) -> dict:
    """`pagellm bench serve` against ``server``: the same prompts and seeds for every server."""
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "serve",
           "--base-url", server.base_url, "--request-rate", ns.rates,
           "--num-prompts", str(ns.num_prompts), "--random-input-len", str(ns.input_len),
           "--random-output-len", str(ns.output_len), "--random-range-ratio",
           str(ns.range_ratio), "--ignore-eos", "--num-warmups", str(ns.num_warmups),
           "--seed", str(ns.seed), "--label", label, "--output-json", str(out_json), *extra]
    if ns.max_concurrency:
        cmd += ["--max-concurrency", str(ns.max_concurrency)]
    print(f"[{label}] sweep: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    with open(out_json, encoding="utf-8") as f:
        sweep = json.load(f)
    if "runs" not in sweep:  # a single rate writes the plain summary
        sweep = {"label": label, "runs": [sweep],
                 "max_sustained_rate": sweep["request_rate"] if sweep.get("sustained") else None}
    sweep["startup_s"] = server.startup_s
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(sweep, f, indent=2)
    return sweep


def combine_runs(runs: list[dict]) -> dict:
    """One rate's repeated runs as one: every latency percentile and throughput the median over
    the runs; sustained if most runs were."""
    out = dict(runs[0])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        out[key] = {stat: statistics.median([r[key][stat] for r in runs]) for stat in runs[0][key]}
    for key in ("duration_s", "request_throughput", "output_throughput", "total_token_throughput"):
        out[key] = statistics.median([r[key] for r in runs])
    out["sustained"] = sum(bool(r.get("sustained")) for r in runs) * 2 > len(runs)
    out["repeats"] = len(runs)
    out.pop("sustained_detail", None)
    return out


def run_interleaved(ns: argparse.Namespace, servers: dict[str, Server], out: Path) -> dict:
    """Every rate ns.repeats times per server, back to back, alternating the order; returns
    {label: sweep} with per-rate medians (combine_runs) and writes them to out/<label>.json."""
    runs_dir = out / "runs"
    runs_dir.mkdir(exist_ok=True)
    rates = [r for r in ns.rates.split(",") if r]
    runs: dict[str, dict[str, list[dict]]] = {label: {r: [] for r in rates} for label in servers}
    labels = list(servers)
    for rep in range(ns.repeats):
        for rate in rates:
            for label in labels if rep % 2 == 0 else labels[::-1]:
                one = argparse.Namespace(**{**vars(ns), "rates": rate})
                sweep = run_sweep(one, servers[label], label,
                                  runs_dir / f"{label}_rate{rate}_rep{rep}.json", [])
                runs[label][rate].append(sweep["runs"][0])
    sweeps = {}
    for label in labels:
        combined = [combine_runs(runs[label][r]) for r in rates]
        sustained = [c["request_rate"] for c in combined if c["sustained"]]
        sweeps[label] = {"label": label, "repeats": ns.repeats, "runs": combined,
                         "max_sustained_rate": max(sustained) if sustained else None,
                         "startup_s": servers[label].startup_s}
    pairs = ["pagellm / vLLM-CPU of each back-to-back pair (TTFT p50, TPOT p50):"]
    for rate in rates:
        cells = []
        for a, b in zip(runs["pagellm"][rate], runs["vllm-cpu"][rate], strict=True):
            cells.append(f"{a['ttft_ms']['median'] / b['ttft_ms']['median']:.2f}/"
                         f"{a['tpot_ms']['median'] / b['tpot_ms']['median']:.2f}")
        pairs.append(f"  rate {rate}: " + "  ".join(cells))
    print("\n".join(pairs), flush=True)
    sweeps["pairs"] = pairs[1:]
    return sweeps


def ratio_table(ours: dict, theirs: dict) -> tuple[str, list[dict]]:
    """Per rate in both sweeps: pagellm / vLLM for p50/p99 TTFT and TPOT, and who sustained."""
    by_rate = {str(r["request_rate"]): r for r in theirs["runs"]}
    head = (f"{'rate':>6} | {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} {'TPOT p99':>8} | "
            f"{'sustained pagellm/vLLM':>22}")
    lines, rows = ["pagellm / vLLM-CPU (below 1: pagellm faster)", head], []
    for a in ours["runs"]:
        b = by_rate.get(str(a["request_rate"]))
        if b is None:
            continue
        row = {"request_rate": a["request_rate"]}
        for key, stat in (("ttft_ms", "median"), ("ttft_ms", "p99"), ("tpot_ms", "median"),
                          ("tpot_ms", "p99")):
            name = f"{key[:4]}_{'p50' if stat == 'median' else stat}_ratio"
            row[name] = a[key][stat] / b[key][stat] if b[key][stat] else None
        row.update(sustained_pagellm=a.get("sustained"), sustained_vllm=b.get("sustained"))
        rows.append(row)
        cells = " ".join(f"{row[k]:>8.2f}" if row[k] is not None else f"{'-':>8}"
                         for k in ("ttft_p50_ratio", "ttft_p99_ratio", "tpot_p50_ratio",
                                   "tpot_p99_ratio"))
        sus = {True: "yes", False: "no", None: "-"}
        lines.append(f"{a['request_rate']!s:>6} | {cells} | "
                     f"{sus[a.get('sustained')] + ' / ' + sus[b.get('sustained')]:>22}")
    lines.append(f"highest sustained rate: pagellm {ours.get('max_sustained_rate')}, "
                 f"vLLM-CPU {theirs.get('max_sustained_rate')}")
    return "\n".join(lines), rows


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="2,4,8", help="request rates, comma-separated (req/s)")
    ap.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5,
                    help="lengths uniform in len x [1 - r, 1 + r]")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--num-warmups", type=int, default=1, help="untimed requests per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out-dir", default="bench_serve_compare")
    ap.add_argument("--skip-vllm", action="store_true", help="pagellm only")
    ap.add_argument("--skip-pagellm", action="store_true",
                    help="vLLM only; compares with DIR/pagellm.json when it is there")
    ap.add_argument("--vllm-python", default="/tmp/venv-vllm/bin/python")
    ap.add_argument("--hf-dir", default=None, help="the model as an HF folder, for vLLM "
                    "(default: pagellm's GGUF conversion cache of the default model)")
    ap.add_argument("--model-config", default=None,
                    help="a folder holding a config.json: that model's shapes, random weights")
    ap.add_argument("--vllm-arg", action="append", default=[],
                    help="extra flag for vLLM's server, e.g. --vllm-arg=--max-num-seqs=64")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds per server")
    ap.add_argument("--repeats", type=int, default=1,
                    help="N >= 2: both servers up, each rate N times per server, interleaved; "
                    "medians reported")
    return ap.parse_known_args(argv)


def pagellm_server(ns: argparse.Namespace, serve_extra: list[str], out: Path) -> Server:
    # Model sizes as in benchmarks/compare_vllm.py: 2048 context, 4 GiB of KV for both.
    return Server("pagellm", [sys.executable, "-m", "pagellm.entrypoints.cli", "serve",
                              "--dtype", ns.dtype, "--max-model-len", str(ns.max_model_len),
                              "--kv-cache-memory", "4GiB", *model_flags(ns), *serve_extra,
                              "--port", str(free_port())],
                  out / "pagellm_server.log", timeout_s=ns.start_timeout)


def model_flags(ns: argparse.Namespace) -> list[str]:
    """Both servers' flags for ``--model-config``: its shapes, random weights, the default
    model's tokenizer (empty without it: each server's default model)."""
    if not ns.model_config:
        return []
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_vllm import default_hf_dir

    return ["--model", ns.model_config, "--load-format", "dummy",
            "--tokenizer", ns.hf_dir or default_hf_dir()]


def vllm_server(ns: argparse.Namespace, out: Path) -> Server:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_vllm import VLLM_ENV, default_hf_dir

    model = model_flags(ns) or ["--model", ns.hf_dir or default_hf_dir()]
    # Prefix caching off as in pagellm's default (the sweep's random prompts share nothing
    # anyway); same dtype and context length.
    return Server("vllm-cpu", [ns.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                               *model, "--dtype", ns.dtype, "--max-model-len",
                               str(ns.max_model_len), "--no-enable-prefix-caching",
                               *ns.vllm_arg, "--host", "127.0.0.1", "--port", str(free_port())],
                  out / "vllm_server.log", env=VLLM_ENV, timeout_s=ns.start_timeout)


def main_interleaved(ns: argparse.Namespace, serve_extra: list[str], out: Path,
                     load: float) -> int:
    servers: dict[str, Server] = {}
    try:
        servers["pagellm"] = pagellm_server(ns, serve_extra, out)
        servers["vllm-cpu"] = vllm_server(ns, out)
        sweeps = run_interleaved(ns, servers, out)
    finally:
        for server in servers.values():
            server.stop()
    paths = {"pagellm": out / "pagellm.json", "vllm-cpu": out / "vllm.json"}
    for label, path in paths.items():
        with open(path, "w", encoding="utf-8") as f:
            json.dump(sweeps[label], f, indent=2)
    png = out / "sweep.png"
    subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "serve",
                    "--plot-only", "--plot", str(png), "--plot-compare",
                    str(paths["pagellm"]), str(paths["vllm-cpu"])], cwd=REPO, check=True)
    table, rows = ratio_table(sweeps["pagellm"], sweeps["vllm-cpu"])
    print(f"medians of {ns.repeats} interleaved runs per rate and server")
    print(table)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_at_start": load,
              "dtype": ns.dtype, "rates": ns.rates, "repeats": ns.repeats,
              "pagellm": str(paths["pagellm"]), "vllm": str(paths["vllm-cpu"]),
              "ratios": rows, "pairs": sweeps["pairs"],
              "max_sustained_rate": {"pagellm": sweeps["pagellm"]["max_sustained_rate"],
                                     "vllm": sweeps["vllm-cpu"]["max_sustained_rate"]}}
    with open(out / "compare.json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}/: pagellm.json, vllm.json, sweep.png, compare.json, runs/")
    return 0


def main(argv: list[str] | None = None) -> int:
    ns, serve_extra = parse_args(argv)
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    print(f"load average at start: {load:.2f}" + ("  (NOT idle: figures unreliable)"
                                                  if load > 0.5 else ""), flush=True)
    ours_json, theirs_json, png = out / "pagellm.json", out / "vllm.json", out / "sweep.png"
    if ns.skip_vllm and ns.skip_pagellm:
        raise SystemExit("error: --skip-vllm and --skip-pagellm leave nothing to run")
    if ns.repeats > 1:
        if ns.skip_vllm or ns.skip_pagellm:
            raise SystemExit("error: --repeats interleaves both servers; drop --skip-*")
        return main_interleaved(ns, serve_extra, out, load)
    ours = None
    if not ns.skip_pagellm:
        server = pagellm_server(ns, serve_extra, out)
        try:
            ours = run_sweep(ns, server, "pagellm", ours_json,
                             [] if not ns.skip_vllm else ["--plot", str(png)])
        finally:
            server.stop()
    elif ours_json.exists():
        with open(ours_json, encoding="utf-8") as f:
            ours = json.load(f)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_at_start": load,
              "dtype": ns.dtype, "rates": ns.rates,
              "pagellm": str(ours_json) if ours is not None else None}
    if not ns.skip_vllm:
        vllm = vllm_server(ns, out)
        try:
            theirs = run_sweep(ns, vllm, "vllm-cpu", theirs_json, ["--plot", str(png)] + (
                ["--plot-compare", str(ours_json)] if ours is not None else []))
        finally:
            vllm.stop()
        result["vllm"] = str(theirs_json)
        if ours is not None:
            table, rows = ratio_table(ours, theirs)
            print(table)
            result.update(ratios=rows,
                          max_sustained_rate={"pagellm": ours.get("max_sustained_rate"),
                                              "vllm": theirs.get("max_sustained_rate")})
    with open(out / "compare.json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}/: " + ", ".join(p.name for p in (ours_json, theirs_json, png)
                                          if p.exists()) + ", compare.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
