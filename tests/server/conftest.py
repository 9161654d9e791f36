"""Servers that several test files share (a server start costs seconds; CI has two cores)."""

from __future__ import annotations

import pytest
from server_utils import ADMIN_ARGS, TOOLS_ARGS, TOOLS_KEY, ServerProcess, serve_tiny_llama


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory, make_tiny_model):
    """``TOOLS_ARGS`` over a tiny llama of 2048 positions (a prompt with tools is some 800 of
    the test tokenizer's tokens), for the render, Responses, structural-tag and tool-calling
    files; ``post`` sends ``TOOLS_KEY`` by default."""
    yield from serve_tiny_llama(tmp_path_factory, make_tiny_model, "tools", TOOLS_ARGS,
                                api_key=TOOLS_KEY, max_position_embeddings=2048)


@pytest.fixture(scope="session")
def admin_weights_root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")  # admin_server's --allowed-weights-path


@pytest.fixture(scope="session")
def admin_server(tmp_path_factory, tiny_llama_dir, admin_weights_root):
    """``ADMIN_ARGS`` (a tenant key, an admin key, no sleep mode) over the session's tiny llama,
    weight updates allowed from ``admin_weights_root``: test_update_weights' server, and the
    server without --enable-sleep-mode of test_sleep_routes. Its weights may change."""
    log = tmp_path_factory.mktemp("admin_server") / "server.log"
    srv = ServerProcess(["--model", str(tiny_llama_dir), *ADMIN_ARGS,
                         "--allowed-weights-path", str(admin_weights_root)], log)
    yield srv
    srv.stop()
