"""Data parallelism on one machine: N ``pagellm serve`` replicas behind a least-loaded proxy.

    python -m pagellm.entrypoints.replicas --data-parallel-size 2 --port 8000 -- MODEL [serve flags]
    python -m pagellm.entrypoints.replicas --backend http://10.0.0.5:8000 --backend ... --port 8000

The first form starts the replicas itself (each on 127.0.0.1 and a free port, each its own engine
with its own KV cache; with ``--devices-per-replica K`` replica i sees GPUs iK..iK+K-1 through
CUDA_VISIBLE_DEVICES, so ``-tp K`` works inside each). The second fronts servers that run
elsewhere. Replicas share nothing, so scaling out is adding replicas; across machines use a real
orchestrator (deploy/ and docs/parallelism.md), which restarts a dead replica, which this
launcher does not: it keeps serving from the others.

The proxy enforces the API keys and the body cap itself (before a replica sees anything), and
the launcher passes the same --api-key, --api-key-file and --max-request-body-bytes to each
replica it starts, so the two never disagree (PAGELLM_API_KEY reaches both through the
environment).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import subprocess
import sys
import time
from typing import Any

from pagellm.config import child_environ, read_env
from pagellm.entrypoints.openai.tenancy import ApiKeys, load_api_keys
from pagellm.entrypoints.replica_proxy import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    Replica,
    ReplicaProxy,
)
from pagellm.worker.multiproc_executor import free_port

logger = logging.getLogger("pagellm")

# Launcher flags that each launched `pagellm serve` gets too (the proxy and replicas agree).
FORWARDED_FLAGS = ("--api-key", "--api-key-file", "--max-request-body-bytes")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m pagellm.entrypoints.replicas",
                                description="N pagellm serve replicas behind one proxy.")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="replicas to launch (the `pagellm serve` flags follow `--`)")
    p.add_argument("--backend", action="append", default=[],
                   help="URL of a running replica to front instead (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--devices-per-replica", type=int, default=None,
                   help="GPUs per replica (sets CUDA_VISIBLE_DEVICES per replica)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between checks")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' at the proxy (repeatable; "
                        "passed to each launched replica; default env PAGELLM_API_KEY); "
                        "/health and /proxy/metrics stay open")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="accept the keys in PATH, as `pagellm serve --api-key-file` (passed "
                        "to each launched replica)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 at the proxy (passed to each launched "
                        "replica; default 8 MiB, as pagellm serve)")
    p.add_argument("--client-timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT_S,
                   help="seconds a client has to send its whole request; slower ones get 408 "
                        "and are cut (default 30)")
    ns = p.parse_args(argv)
    if (ns.data_parallel_size is None) == (not ns.backend):
        p.error("give either --data-parallel-size N (and the serve flags after --) or --backend")
    if ns.data_parallel_size is not None and ns.data_parallel_size < 1:
        p.error(f"--data-parallel-size must be >= 1, got {ns.data_parallel_size}")
    if ns.backend and serve_args:
        p.error("serve flags after -- are only for launched replicas (--data-parallel-size)")
    for arg in serve_args:
        flag = arg.split("=", 1)[0]
        if flag in FORWARDED_FLAGS:
            p.error(f"give {flag} before --: the proxy checks it too, and the launcher passes "
                    "it to each replica")
    if ns.max_request_body_bytes < 1 or ns.client_timeout <= 0:
        p.error("--max-request-body-bytes and --client-timeout must be positive")
    try:
        ns.api_keys = load_api_keys(ns.api_key, ns.api_key_file, read_env().api_key)
    except ValueError as e:
        p.error(str(e))
    return ns, serve_args


def replica_serve_args(ns: argparse.Namespace, serve_args: list[str]) -> list[str]:
    """The serve flags of each launched replica: the user's, plus the forwarded flags."""
    out = list(serve_args)
    for key in ns.api_key or ():
        out += ["--api-key", key]
    if ns.api_key_file:
        out += ["--api-key-file", ns.api_key_file]
    return out + ["--max-request-body-bytes", str(ns.max_request_body_bytes)]


def _die_with_parent() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch_replicas(n: int, serve_args: list[str], devices_per_replica: int | None
                    ) -> list[tuple[Replica, subprocess.Popen]]:
    """Start ``n`` `pagellm serve` processes (they log to this process's stdout/stderr)."""
    out = []
    for i in range(n):
        port = free_port()
        overrides: dict[str, str] = {}
        if devices_per_replica:
            first = i * devices_per_replica
            overrides["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(d) for d in range(first, first + devices_per_replica))
        env = child_environ(overrides)
        cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", *serve_args,
               "--host", "127.0.0.1", "--port", str(port)]
        # The replica dies with us, whatever kills us (no orphaned servers holding GPUs).
        proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)
        logger.info("replica %d: pid %d on 127.0.0.1:%d", i, proc.pid, port)
        out.append((Replica(i, f"http://127.0.0.1:{port}", pid=proc.pid), proc))
    return out


def stop_replicas(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _wait_first_healthy(proxy: ReplicaProxy, procs: list[subprocess.Popen],
                              timeout_s: float) -> None:
    """Block until every launched replica answers /health (or exits: then fail)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for replica, proc in zip(proxy.replicas, procs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"replica {replica.index} exited with {proc.returncode} "
                                   "during start-up")
        await asyncio.gather(*(proxy._check(r) for r in proxy.replicas))
        if all(r.healthy for r in proxy.replicas):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the replicas did not become healthy within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s [replicas] %(message)s")
    ns, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    procs: list[subprocess.Popen] = []
    if ns.backend:
        replicas = [Replica(i, url.rstrip("/")) for i, url in enumerate(ns.backend)]
    else:
        launched = launch_replicas(ns.data_parallel_size, replica_serve_args(ns, serve_args),
                                   ns.devices_per_replica)
        replicas = [r for r, _ in launched]
        procs = [p for _, p in launched]
    api_keys: ApiKeys | None = ns.api_keys
    if api_keys is not None:
        logger.info("%s at the proxy.", api_keys.describe())
    proxy = ReplicaProxy(replicas, health_interval_s=ns.health_interval, api_keys=api_keys,
                         max_body_bytes=ns.max_request_body_bytes,
                         client_timeout_s=ns.client_timeout)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)

    async def run() -> None:
        if procs:
            await _wait_first_healthy(proxy, procs, ns.startup_timeout)
        await proxy.serve(ns.host, ns.port)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        logger.info("Stopping.")
    except RuntimeError as e:
        logger.error("%s", e)
        raise SystemExit(1) from None
    finally:
        stop_replicas(procs)


if __name__ == "__main__":
    main()
