"""vLLM's sleep-mode routes on a real server over a tiny model: ``POST /sleep?level=N``,
``POST /wake_up``, ``GET /is_sleeping``, behind an admin key (a tenant key gets 403) and only
with --enable-sleep-mode; a generation request while asleep is a 503; after waking the tokens are
those from before."""

from __future__ import annotations

import httpx
import pytest
from server_utils import ADMIN_ARGS, ADMIN_KEY, ADMIN_TENANT_KEY, ServerProcess

API_KEY = ADMIN_TENANT_KEY
PROMPT = [5, 17, 42, 99, 7, 64, 23, 11]


def call(server, method, path, body=None, key=ADMIN_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{server.base_url}{path}", json=body, headers=headers,
                         timeout=300)


def complete(server) -> httpx.Response:
    return call(server, "POST", "/v1/completions",
                {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                key=API_KEY)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(["--model", str(tiny_llama_dir), *ADMIN_ARGS, "--enable-sleep-mode"], log)
    yield srv
    srv.stop()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake(server, level) -> None:
    before = complete(server)
    assert before.status_code == 200, before.text
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    r = call(server, "POST", f"/sleep?level={level}")
    assert r.status_code == 200, r.text
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": True}
    asleep = complete(server)
    assert asleep.status_code == 503, asleep.text
    assert asleep.json()["error"]["code"] == "engine_sleeping"
    assert "wake_up" in asleep.json()["error"]["message"]
    assert call(server, "POST", "/wake_up").status_code == 200
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}
    after = complete(server)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def test_bad_level_is_400(server) -> None:
    r = call(server, "POST", "/sleep?level=3")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "level"
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}


@pytest.mark.parametrize("method,path", [("POST", "/sleep"), ("POST", "/wake_up"),
                                         ("GET", "/is_sleeping")])
def test_needs_an_admin_key(server, method, path) -> None:
    assert call(server, method, path, key=None).status_code == 401
    r = call(server, method, path, key=API_KEY)  # a tenant's key
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required", r.text
    assert call(server, "GET", "/is_sleeping").json() == {"is_sleeping": False}


def test_no_routes_without_the_flag(admin_server) -> None:
    """The same flags and keys without --enable-sleep-mode (the shared admin_server)."""
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]:
        assert call(admin_server, method, path).status_code == 404
    assert complete(admin_server).status_code == 200
