"""Start a real ``pagellm serve`` in a subprocess on 127.0.0.1 and a free port."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pagellm.entrypoints.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# The default model, small settings: 135M parameters, fp32 on the CPU.
TINY_ARGS = ["--dtype", "float32", "--kv-cache-memory", "512MiB", "--max-model-len", "1024"]
START_TIMEOUT_S = 600.0
SERVE_MODULE = ("pagellm.entrypoints.openai.cli_serve",)
PAGELLM_SERVE = ("pagellm.entrypoints.cli", "serve")  # the `pagellm serve` command itself
# One server for every test file of the tool and reasoning parsers' flags (the session fixture
# ``tools_server`` of conftest.py): a tiny llama of 2048 positions, the hermes tool parser, the
# deepseek_r1 reasoning parser, chatml_tools and two API keys (two tenants).
TOOLS_KEY, TOOLS_KEY_B = "sk-tools-a-0123456789", "sk-tools-b-9876543210"
TOOLS_ARGS = ["--served-model-name", "m", "--dtype", "float32", "--max-model-len", "2048",
              "--kv-cache-memory", "16MiB", "--api-key", TOOLS_KEY, "--api-key", TOOLS_KEY_B,
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
              "--reasoning-parser", "deepseek_r1", "--chat-template", "chatml_tools"]
# A tenant key and an admin key over the session's tiny llama (the session fixture
# ``admin_server`` adds --allowed-weights-path; test_sleep_routes adds --enable-sleep-mode).
ADMIN_TENANT_KEY, ADMIN_KEY = "rl-key", "rl-admin-key"
ADMIN_ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256",
              "--api-key", ADMIN_TENANT_KEY, "--admin-api-key", ADMIN_KEY,
              "--enable-prefix-caching"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def serve_tiny_llama(tmp_path_factory, make_tiny_model, name: str, args: list[str],
                     api_key: str | None = None, **config) -> Iterator[ServerProcess]:
    """A server of a fresh tiny llama (``config``: its config overrides) in a temporary folder
    ``name``, stopped when the generator closes: a module fixture's body (``yield from``).
    ``api_key``: the key ``post`` and ``sse_events`` send unless told otherwise."""
    root = tmp_path_factory.mktemp(name)
    model = make_tiny_model(root / "model", "llama", **config)
    srv = ServerProcess([str(model), *args], root / "server.log")
    if api_key is not None:
        srv.headers = bearer(api_key)
    try:
        yield srv
    finally:
        srv.stop()


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 command: tuple[str, ...] = SERVE_MODULE, new_session: bool = False):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.headers: dict[str, str] = {}  # what post() and sse_events() send by default
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        cmd = [sys.executable, "-m", *command, *args,
               "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=new_session)
        self.wait_healthy()

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not start:\n{self.log()}")

    @property
    def engine_pid(self) -> int:
        match = re.search(r"Engine core process started \(pid (\d+)\)", self.log())
        assert match, self.log()
        return int(match.group(1))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0,
             group: bool = False) -> int:
        """Signal the server (or, with ``group``, its whole process group, as Ctrl-C in a
        terminal does) and wait for it."""
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def post(server: ServerProcess, path: str, body: dict, headers: dict | None = None,
         timeout: float = 120) -> httpx.Response:
    """POST ``body`` as JSON, with the server's default headers unless ``headers`` is given."""
    return httpx.post(f"{server.base_url}{path}", json=body,
                      headers=server.headers if headers is None else headers, timeout=timeout)


def ok(r: httpx.Response) -> Any:
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(server: ServerProcess, path: str, body: dict,
               headers: dict | None = None) -> list[dict]:
    """The data events of a streamed POST (an event stream ending in ``[DONE]``), parsed."""
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=120,
                      headers=server.headers if headers is None else headers) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent has not reaped it yet).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}, without help/type lines."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def drained(base_url: str) -> bool:
    """No request running or waiting, and no KV block held (every block back in the pool)."""
    m = scrape(base_url)
    return (metric(m, "pagellm:num_requests_running") == 0
            and metric(m, "pagellm:num_requests_waiting") == 0
            and metric(m, "pagellm:kv_cache_usage_perc") == 0)


def load_soak():
    """scripts/soak.py as a module (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("soak", REPO / "scripts" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module
