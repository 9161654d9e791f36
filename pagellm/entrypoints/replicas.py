"""Data parallelism on one machine: N ``pagellm serve`` replicas behind vllm-router.

    python -m pagellm.entrypoints.replicas -dp 2 [--policy cache_aware] --port 8000 -- MODEL \
        [serve flags]
    python -m pagellm.entrypoints.replicas --backend http://10.0.0.5:8000 --backend ... --port 8000

The first form starts the replicas itself (each on 127.0.0.1 and a free port, each its own engine
with its own KV cache; with ``--devices-per-replica K`` replica i sees GPUs iK..iK+K-1 through
CUDA_VISIBLE_DEVICES, so ``-tp K`` works inside each), waits until every one answers /health,
then starts vllm-router (``pip install 'pagellm[router]'``) in front of them and waits for it.
The router listens on 127.0.0.1 only: its management API (/add_worker, /list_workers, ...) is
open to anyone who reaches it, so clients reach it through the router gate (router_gate.py) on
--host/--port, which forwards /v1/* and the health probes and nothing else.
A replica whose port another process takes before it listens starts again on a new port.
The second form starts only the router, in front of servers that run elsewhere. Replicas share
nothing, so scaling out is adding replicas; across machines use an orchestrator (deploy/ and
docs/parallelism.md), which restarts a dead replica: this launcher does not, the router routes
around it.

The router checks no client key and no body: the launcher hands its keys (--api-key,
--admin-api-key, --api-key-file, PAGELLM_API_KEY, PAGELLM_ADMIN_API_KEY) to each replica it starts
in a file only this user can read (never on a command line: ``ps`` shows those to every user)
and passes --max-request-body-bytes; each replica enforces them (the router forwards the
client's Authorization header). The body cap also goes to the gate and the router.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from pagellm.config import API_KEY_ENV_VARS, child_environ, read_env
from pagellm.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagellm.entrypoints.openai.tenancy import load_api_keys, write_api_key_file
from pagellm.entrypoints.ports import free_port, port_taken
from pagellm.entrypoints.replica_router import (
    ROUTER_POLICIES,
    RouterNotInstalledError,
    RouterOptions,
    check_router_installed,
    die_with_parent,
    start_router,
)

logger = logging.getLogger("pagellm")

# Launcher flags that each launched `pagellm serve` gets too (the keys through a file).
FORWARDED_FLAGS = ("--api-key", "--admin-api-key", "--api-key-file", "--max-request-body-bytes")
ROUTER_HOST = "127.0.0.1"  # the router's management API must not face clients
# Starts of one replica whose port another process took before it listened (free_port releases
# the port it finds; `pagellm serve` listens before it loads the model).
REPLICA_START_ATTEMPTS = 3


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    serve_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, serve_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m pagellm.entrypoints.replicas",
                                description="N pagellm serve replicas behind vllm-router.")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="replicas to launch (the `pagellm serve` flags follow `--`)")
    p.add_argument("--backend", action="append", default=[],
                   help="URL of a running replica to front instead (repeatable)")
    p.add_argument("--policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="vllm-router's routing policy (default cache_aware: requests that share "
                        "a prefix go to the replica that has it cached)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the client-facing address (the router gate's; the router itself "
                        "listens on 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the client-facing port")
    p.add_argument("--router-metrics-port", type=int, default=None,
                   help="the router's own Prometheus port (default: a free port)")
    p.add_argument("--router-log-level", default="warning",
                   help="vllm-router's log level")
    p.add_argument("--router-args", default="", metavar="'ARGS'",
                   help="more vllm-router flags, as one shell-quoted string (e.g. "
                        "'--cache-threshold 0.5')")
    p.add_argument("--devices-per-replica", type=int, default=None,
                   help="GPUs per replica (sets CUDA_VISIBLE_DEVICES per replica)")
    p.add_argument("--health-interval", type=int, default=5,
                   help="seconds between the router's health checks of each replica")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--api-key", action="append", default=None,
                   help="each launched replica requires 'Authorization: Bearer KEY' "
                        "(repeatable; default env PAGELLM_API_KEY); the router forwards it")
    p.add_argument("--admin-api-key", action="append", default=None, metavar="KEY",
                   help="each launched replica accepts KEY with the admin role (repeatable; "
                        "default env PAGELLM_ADMIN_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="each launched replica accepts the keys in PATH, as `pagellm serve "
                        "--api-key-file`")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies are refused, by the router (413) and by each "
                        "launched replica (default 8 MiB, as pagellm serve)")
    ns = p.parse_args(argv)
    if (ns.data_parallel_size is None) == (not ns.backend):
        p.error("give either --data-parallel-size N (and the serve flags after --) or --backend")
    if ns.data_parallel_size is not None and ns.data_parallel_size < 1:
        p.error(f"--data-parallel-size must be >= 1, got {ns.data_parallel_size}")
    if ns.backend and serve_args:
        p.error("serve flags after -- are only for launched replicas (--data-parallel-size)")
    if ns.policy == "power_of_two" and (ns.data_parallel_size or len(ns.backend)) < 2:
        p.error("--policy power_of_two needs at least 2 replicas (vllm-router refuses it with "
                "one)")
    for arg in serve_args:
        flag = arg.split("=", 1)[0]
        if flag in FORWARDED_FLAGS:
            p.error(f"give {flag} before --: the launcher passes it to each replica")
    try:
        env = read_env()
        ns.keys = load_api_keys(ns.api_key, ns.api_key_file, env.api_key, ns.admin_api_key,
                                env.admin_api_key)
        ns.router = RouterOptions(
            policy=ns.policy, host=ROUTER_HOST, port=0, metrics_host=ns.host,  # port 0: later
            metrics_port=ns.router_metrics_port or 0,  # 0: a free port when it starts
            max_payload_bytes=ns.max_request_body_bytes, health_interval_s=ns.health_interval,
            startup_timeout_s=max(1, int(ns.startup_timeout)), log_level=ns.router_log_level,
            extra_args=shlex.split(ns.router_args))
    except ValueError as e:
        p.error(str(e))
    return ns, serve_args


def replica_serve_args(ns: argparse.Namespace, serve_args: list[str], key_dir: str
                       ) -> list[str]:
    """The serve flags of each launched replica: the user's, plus the forwarded flags; the
    keys, if any, go into a file under ``key_dir`` (a private temporary folder)."""
    out = list(serve_args)
    if ns.keys is not None:
        path = os.path.join(key_dir, "api-keys")
        write_api_key_file(ns.keys, path)
        out += ["--api-key-file", path]
    return out + ["--max-request-body-bytes", str(ns.max_request_body_bytes)]


@dataclasses.dataclass
class Replica:
    """One launched `pagellm serve` process (it logs to this process's stdout/stderr)."""
    index: int
    port: int
    proc: subprocess.Popen
    starts: int = 1

    @property
    def name(self) -> str:
        return f"replica {self.index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclasses.dataclass
class ReplicaSet:
    """The launched replicas, by name."""
    serve_args: list[str]
    devices_per_replica: int | None = None
    replicas: dict[str, Replica] = dataclasses.field(default_factory=dict)

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {name: r.proc for name, r in self.replicas.items()}

    @property
    def urls(self) -> dict[str, str]:
        return {name: r.url for name, r in self.replicas.items()}

    def launch(self, i: int, starts: int = 1) -> Replica:
        """Start replica ``i`` on 127.0.0.1 and a free port (its ``starts``-th start)."""
        port = free_port()
        overrides: dict[str, str] = {}
        if self.devices_per_replica:
            first = i * self.devices_per_replica
            overrides["CUDA_VISIBLE_DEVICES"] = ",".join(
                str(d) for d in range(first, first + self.devices_per_replica))
        cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", *self.serve_args,
               "--host", "127.0.0.1", "--port", str(port)]
        # The replica dies with us, whatever kills us (no orphaned servers holding GPUs).
        # No key variable: a replica gets every key from its --api-key-file.
        env = child_environ(overrides, without=API_KEY_ENV_VARS)
        proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
        replica = Replica(i, port, proc, starts)
        logger.info("%s: pid %d on 127.0.0.1:%d", replica.name, proc.pid, port)
        self.replicas[replica.name] = replica
        return replica

    def relaunch_if_port_lost(self, name: str) -> tuple[subprocess.Popen, str] | None:
        """For wait_healthy: a replica that exited during start-up because another process
        holds its port now starts again on a new one (up to REPLICA_START_ATTEMPTS starts);
        its new process and health URL, or None (any other exit fails the start)."""
        old = self.replicas[name]
        if not port_taken(old.port) or old.starts >= REPLICA_START_ATTEMPTS:
            return None
        logger.warning("%s: another process took port %d while it started; starting it again "
                       "on a new port", name, old.port)
        new = self.launch(old.index, old.starts + 1)
        return new.proc, f"{new.url}/health"


def launch_replicas(n: int, serve_args: list[str], devices_per_replica: int | None
                    ) -> ReplicaSet:
    """Start ``n`` `pagellm serve` processes."""
    replicas = ReplicaSet(serve_args, devices_per_replica)
    for i in range(n):
        replicas.launch(i)
    return replicas


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 30.0) -> None:
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


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(named: dict[str, subprocess.Popen], urls: dict[str, str], timeout_s: float,
                 restart: Callable[[str], tuple[subprocess.Popen, str] | None] | None = None
                 ) -> None:
    """Until every ``urls[name]`` answers 200; fail if its process exits first, unless
    ``restart(name)`` starts it again (its new process and URL)."""
    deadline = time.monotonic() + timeout_s
    named, pending = dict(named), dict(urls)
    while pending:
        for name in list(pending):
            proc = named[name]
            if proc.poll() is not None:
                again = restart(name) if restart is not None else None
                if again is None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
                named[name], pending[name] = again
                continue
            if http_ok(pending[name]):
                logger.info("%s is up", name)
                del pending[name]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(pending)} did not become healthy within "
                               f"{timeout_s:.0f} s")
        if pending:
            time.sleep(0.5)


def watch(front: dict[str, subprocess.Popen], replicas: dict[str, subprocess.Popen]) -> None:
    """Serve until a signal; a replica that exits is logged (the router routes around it), a
    front process (the router, its gate) that exits ends the launcher."""
    exited: set[str] = set()
    while all(proc.poll() is None for proc in front.values()):
        for name, proc in replicas.items():
            if name not in exited and proc.poll() is not None:
                exited.add(name)
                logger.warning("%s exited with %s; the router routes around it (%d of %d "
                               "left)", name, proc.returncode, len(replicas) - len(exited),
                               len(replicas))
        time.sleep(0.5)
    name, proc = next((n, p) for n, p in front.items() if p.poll() is not None)
    raise RuntimeError(f"{name} exited with {proc.returncode}")


def start_gate(router_url: str, host: str, port: int, max_body_bytes: int) -> subprocess.Popen:
    """The router gate (router_gate.py) on the client-facing address, in front of the router."""
    cmd = [sys.executable, "-m", "pagellm.entrypoints.router_gate", "--upstream", router_url,
           "--host", host, "--port", str(port), "--max-request-body-bytes", str(max_body_bytes)]
    proc = subprocess.Popen(cmd, preexec_fn=die_with_parent)
    logger.info("router gate: pid %d on http://%s:%d -> %s (/v1/* and the probes only)",
                proc.pid, host, port, router_url)
    return proc


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s [replicas] %(message)s")
    ns, serve_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_router_installed()  # before any replica starts
    except RouterNotInstalledError as e:
        logger.error("%s", e)
        raise SystemExit(2) from None

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    front: dict[str, subprocess.Popen] = {}
    replicas = ReplicaSet([])
    key_dir = tempfile.TemporaryDirectory(prefix="pagellm-replicas-")  # mode 0700
    try:
        if ns.backend:
            urls = [url.rstrip("/") for url in ns.backend]
        else:
            replicas = launch_replicas(ns.data_parallel_size,
                                       replica_serve_args(ns, serve_args, key_dir.name),
                                       ns.devices_per_replica)
            wait_healthy(replicas.procs, {name: f"{url}/health"
                                          for name, url in replicas.urls.items()},
                         ns.startup_timeout, restart=replicas.relaunch_if_port_lost)
            urls = list(replicas.urls.values())
        # The router's ports, unless given, are picked now, not minutes earlier.
        options = dataclasses.replace(ns.router, port=free_port(),
                                      metrics_port=ns.router.metrics_port or free_port())
        front["vllm-router"] = start_router(urls, options)
        router_url = f"http://{ROUTER_HOST}:{options.port}"
        # /readiness: 200 once the router serves with at least one healthy replica (its
        # /health is 503 while any replica is down, e.g. one of several --backend servers).
        wait_healthy(front, {"vllm-router": f"{router_url}/readiness"}, ns.startup_timeout)
        front["router gate"] = start_gate(router_url, ns.host, ns.port,
                                          ns.max_request_body_bytes)
        wait_healthy({"router gate": front["router gate"]},
                     {"router gate": f"http://{_local(ns.host)}:{ns.port}/readiness"},
                     ns.startup_timeout)
        logger.info("Serving on http://%s:%d (policy %s, %d replicas; router management API "
                    "on %s only).", ns.host, ns.port, ns.policy, len(urls), router_url)
        watch(front, {f"{name} ({replicas.urls[name]})": proc
                      for name, proc in replicas.procs.items()})
    except KeyboardInterrupt:
        logger.info("Stopping.")
    except RuntimeError as e:
        logger.error("%s", e)
        raise SystemExit(1) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop
        # The gate and the router first: they stop taking requests first.
        stop_processes([*reversed(front.values()), *replicas.procs.values()])
        key_dir.cleanup()


def _local(host: str) -> str:
    """An address this machine can reach the router at."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


if __name__ == "__main__":
    main()
