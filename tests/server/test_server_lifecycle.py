"""Process lifecycle of ``pagellm serve``: flags as vLLM users write them, start-up errors,
and SIGTERM/SIGINT shutting everything down with no orphan process."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from server_utils import PAGELLM_SERVE, REPO, ServerProcess, pid_alive, wait_until

from pagellm.entrypoints.cli_args import engine_args_from
from pagellm.entrypoints.openai.cli_serve import add_serve_parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagellm")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_vllm_example_command_parses():
    ns = parse("serve MODEL --dtype float16 --max-model-len 8000 --max-num-seqs 160 "
               "--max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 --port 8000".split())
    args = engine_args_from(ns)
    assert (args.model, args.dtype, args.max_model_len, args.max_num_seqs) == \
        ("MODEL", "float16", 8000, 160)
    assert args.max_num_batched_tokens == 8192 and args.gpu_memory_utilization == 0.9
    assert (ns.port, ns.host) == (8000, "127.0.0.1")  # nothing exposed unless asked


def test_server_flags_parse():
    ns = parse(["serve", "--host", "0.0.0.0", "--api-key", "k", "--served-model-name", "a", "b",
                "--chat-template", "t.jinja", "--disable-log-stats", "--enable-log-requests",
                "--uvicorn-log-level", "warning", "--enable-prefix-caching",
                "--tensor-parallel-size", "1"])
    assert ns.host == "0.0.0.0" and ns.api_key == ["k"] and ns.served_model_name == ["a", "b"]
    assert ns.disable_log_stats and ns.enable_log_requests and ns.enable_prefix_caching
    assert ns.uvicorn_log_level == "warning" and ns.chat_template == "t.jinja"


def test_bad_flag_value_exits_with_a_clear_message():
    r = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.openai.cli_serve",
                        "--max-model-len", "999999", "--dtype", "float32"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "--max-model-len 999999" in r.stderr


def test_a_taken_port_fails_before_the_model_loads(tiny_model_dir):
    """serve listens before it builds the engine: a taken port is a clear error at once (no
    engine process started), not uvicorn's after the model loaded."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.openai.cli_serve",
                            str(tiny_model_dir("llama")), "--dtype", "float32",
                            "--max-model-len", "256", "--port", str(port)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert f"cannot listen on --host 127.0.0.1 --port {port}: Address already in use" in r.stderr
    assert "[engine]" not in r.stderr  # nothing loaded


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory, make_tiny_model):
    return make_tiny_model(tmp_path_factory.mktemp("lifecycle-model"), "llama",
                           max_position_embeddings=4096)


# SIGTERM to the server (systemd, docker stop), Ctrl-C (SIGINT to the whole process group) and
# kill -9, with a tiny random model (it starts fast) of 4096 positions: the request, as long as
# the context, is surely still running when the signal comes.
@pytest.mark.parametrize(("sig", "group"), [(signal.SIGTERM, False), (signal.SIGINT, True),
                                            (signal.SIGKILL, False)],
                         ids=["sigterm", "ctrl-c", "kill-9"])
def test_signal_shuts_down_cleanly_mid_request(long_context_llama, tmp_path, sig, group):
    model_args = [str(long_context_llama), "--dtype", "float32", "--kv-cache-memory", "64MiB",
                  "--max-model-len", "4096"]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    srv = ServerProcess([*model_args, "--disable-log-stats", "--enable-log-requests",
                         "--chat-template", str(template)], tmp_path / "server.log",
                        command=PAGELLM_SERVE, new_session=group)
    engine_pid = srv.engine_pid
    # --chat-template replaces the tokenizer's template.
    chat = httpx.post(f"{srv.base_url}/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    plain = httpx.post(f"{srv.base_url}/tokenize",
                       json={"prompt": "<<hi>>", "add_special_tokens": False}).json()
    assert chat["tokens"] == plain["tokens"]
    started = threading.Event()

    def stream_forever():
        # max_tokens null: as long as the context allows.
        body = {"prompt": "Once upon a time", "max_tokens": None, "stream": True,
                "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body,
                              timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream_forever, daemon=True)
    t.start()
    assert started.wait(120)
    code = srv.stop(sig, timeout_s=60, group=group)
    # SIGKILL cannot be handled: the engine process still goes (parent-death signal).
    assert code == (-9 if sig == signal.SIGKILL else 0), srv.log()
    assert wait_until(lambda: not pid_alive(engine_pid), timeout_s=10)
    t.join(30)
    assert not t.is_alive()
    assert "Received request cmpl-" in srv.log()  # --enable-log-requests
