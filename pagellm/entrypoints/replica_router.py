"""vllm-router in front of ``pagellm serve`` replicas: its command line and its process.

vllm-router (PyPI ``vllm-router``, the ``router`` extra: ``pip install 'pagellm[router]'``) is a
Rust HTTP router with cache-aware, power-of-two, round-robin, ... policies. What it asks of a
worker, and what pagellm answers (docs/parallelism.md has the details):

- ``GET /health`` (start-up and periodic checks; 200 = healthy), no API key sent;
- ``GET /get_load`` (``{"load": N}``, polled by power_of_two), no API key sent: open in pagellm;
- cache_aware tokenizes each text request on every worker: ``POST /v1/chat/completions/render``
  (or ``/v1/completions/render``, vLLM's; serving_render.py), falling back to ``POST /tokenize``
  only where a worker has no render endpoint;
- ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ... forwarded with the client's
  headers (``Authorization`` included), streams passed through. The router re-serializes the
  body: it adds its own defaults (``no_stop_trim``, ``return_hidden_states``, ...), which
  pagellm accepts at those values; it drops null fields and ``stream_options.continuous_usage_
  stats``, and refuses a chat ``logprobs: null`` itself (422, plain text).

The router checks no client key: each replica enforces ``--api-key`` and the body cap itself.
Its management API (``/add_worker``, ``/remove_worker``, ``/list_workers``, ``/flush_cache``,
``/workers/...``) answers anyone, whatever its ``--api-key`` (that key is only sent to workers):
the launcher binds it to 127.0.0.1 and puts router_gate.py on the client-facing port.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import subprocess
import sys
from dataclasses import dataclass, field

logger = logging.getLogger("pagellm")

INSTALL_HINT = "pip install 'pagellm[router]'"
# kv_aware (also in vllm-router) needs KV-cache events over ZMQ, which pagellm does not publish.
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random", "consistent_hash",
                   "sticky_least_loaded")
ROUTER_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class RouterNotInstalledError(RuntimeError):
    pass


def check_router_installed() -> None:
    """Raise with the fix when the vllm-router package (and its Rust extension) is missing."""
    for module in ("vllm_router", "vllm_router_rs"):
        if importlib.util.find_spec(module) is None:
            raise RouterNotInstalledError(
                f"vllm-router is not installed (no module {module!r}); the replicas launcher "
                f"runs it in front of the replicas. Install it with: {INSTALL_HINT}")


@dataclass
class RouterOptions:
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    metrics_host: str = "127.0.0.1"  # the router's own Prometheus endpoint (read-only)
    metrics_port: int = 29000
    max_payload_bytes: int = 8 * 2**20
    health_interval_s: int = 5  # between the router's checks of each worker's /health
    load_poll_interval_s: int = 1  # power_of_two polls /get_load this often
    startup_timeout_s: int = 900
    log_level: str = "warning"
    extra_args: list[str] = field(default_factory=list)  # passed to vllm-router as they are

    def __post_init__(self) -> None:
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(ROUTER_POLICIES)}, got "
                             f"{self.policy!r}.")
        if self.log_level not in ROUTER_LOG_LEVELS:
            raise ValueError(f"--router-log-level must be one of {', '.join(ROUTER_LOG_LEVELS)}"
                             f", got {self.log_level!r}.")
        for name, flag in (("health_interval_s", "--health-interval"),
                           ("load_poll_interval_s", "load_poll_interval_s"),
                           ("max_payload_bytes", "--max-request-body-bytes"),
                           ("startup_timeout_s", "--startup-timeout")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}.")


def router_command(worker_urls: list[str], opts: RouterOptions) -> list[str]:
    """The vllm-router command line (run with this interpreter, so the same environment)."""
    return [sys.executable, "-m", "vllm_router.launch_router",
            "--worker-urls", *worker_urls,
            "--policy", opts.policy,
            "--host", opts.host, "--port", str(opts.port),
            "--prometheus-host", opts.metrics_host, "--prometheus-port", str(opts.metrics_port),
            "--max-payload-size", str(opts.max_payload_bytes),
            "--health-check-interval-secs", str(opts.health_interval_s),
            # Also the period of power_of_two's /get_load polling (vllm-router reuses it).
            "--worker-startup-check-interval", str(opts.load_poll_interval_s),
            "--worker-startup-timeout-secs", str(opts.startup_timeout_s),
            "--log-level", opts.log_level,
            *opts.extra_args]


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the launcher dies, whatever kills it."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_router(worker_urls: list[str], opts: RouterOptions) -> subprocess.Popen:
    cmd = router_command(worker_urls, opts)
    proc = subprocess.Popen(cmd, preexec_fn=die_with_parent)
    logger.info("vllm-router (policy %s): pid %d on http://%s:%d, metrics on port %d -> %s",
                opts.policy, proc.pid, opts.host, opts.port, opts.metrics_port,
                ", ".join(worker_urls))
    return proc
