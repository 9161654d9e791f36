"""The admin role (no model: the real app over the fake engine core): the routes that act for
every tenant answer 403 to a tenant key and to a server without keys (unless
--enable-admin-routes), and run for an admin key; --api-key-file's role field; the weights
path stays under --allowed-weights-path whatever the path says."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from server_fakes import run_fake_server
from server_utils import REPO

from pagellm.entrypoints.openai.admin_routes import AdminOptions, resolve_weights_path
from pagellm.entrypoints.openai.serving_errors import OpenAIError
from pagellm.entrypoints.openai.tenancy import (
    ADMIN,
    ADMIN_PATHS,
    TENANT,
    ApiKey,
    ApiKeys,
    load_api_keys,
    parse_api_key_file,
    write_api_key_file,
)

TENANT_KEY, ADMIN_KEY = "sk-tenant", "sk-admin"
KEYS = ApiKeys([ApiKey(TENANT_KEY, "team"), ApiKey(ADMIN_KEY, "ops", ADMIN)])
# The fake core has no sleep mode: the one admin route it serves.
ROUTE = "/reset_prefix_cache"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def run(coro_fn, **app_kwargs) -> None:
    run_fake_server(lambda client, _: coro_fn(client), app_kwargs=app_kwargs)


def test_tenant_keys_get_403_and_admin_keys_run_the_route() -> None:
    async def check(client) -> None:
        r = await client.post(ROUTE, headers=bearer(TENANT_KEY))
        assert r.status_code == 403, r.text
        err = r.json()["error"]
        assert err["code"] == "admin_key_required" and "--admin-api-key" in err["message"]
        assert (await client.post(ROUTE)).status_code == 401
        r = await client.post(ROUTE, headers=bearer(ADMIN_KEY))
        assert r.status_code == 200 and r.json() == {"success": True}
        # An admin key is a tenant of its own for everything else.
        r = await client.post("/v1/completions", headers=bearer(ADMIN_KEY),
                              json={"prompt": "w1 w2", "max_tokens": 2})
        assert r.status_code == 200, r.text

    run(check, api_key=KEYS)


@pytest.mark.parametrize("enable, status", [(False, 403), (True, 200)])
def test_without_keys_the_admin_routes_are_off_unless_enabled(enable, status) -> None:
    async def check(client) -> None:
        r = await client.post(ROUTE)
        assert r.status_code == status, r.text
        if status == 403:
            err = r.json()["error"]
            assert err["code"] == "admin_routes_disabled"
            assert "--enable-admin-routes" in err["message"]

    run(check, admin=AdminOptions(enable_admin_routes=enable))


def test_every_admin_route_is_guarded() -> None:
    """Whatever routes the app has, each of ADMIN_PATHS it serves refuses a tenant key."""
    async def check(client) -> None:
        spec = (await client.get("/openapi.json")).json()
        served = {p for p in spec["paths"] if p in ADMIN_PATHS}
        assert ROUTE in served and "/update_weights_from_disk" in served
        for path in served:
            for method in spec["paths"][path]:
                r = await client.request(method.upper(), path, headers=bearer(TENANT_KEY))
                assert r.status_code == 403, (path, r.text)

    run(check, api_key=KEYS)


def test_update_weights_needs_a_root(tmp_path) -> None:
    async def check(client) -> None:
        r = await client.post("/update_weights_from_disk", headers=bearer(ADMIN_KEY),
                              json={"model_path": str(tmp_path)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "model_path" and "--allowed-weights-path" in err["message"]

    run(check, api_key=KEYS)


def test_weights_paths_resolve_under_the_root_only(tmp_path) -> None:
    root = tmp_path / "root"
    (root / "ckpt").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    real = os.path.realpath(root)
    assert resolve_weights_path(str(root), "ckpt") == os.path.join(real, "ckpt")
    assert resolve_weights_path(str(root), str(root / "ckpt")) == os.path.join(real, "ckpt")
    assert resolve_weights_path(str(root), "not/there/yet") == os.path.join(real, "not/there/yet")
    for given in ("..", "../outside", str(tmp_path / "outside"), "escape", "ckpt/../../outside",
                  "/", "~"):
        with pytest.raises(OpenAIError) as e:
            resolve_weights_path(str(root), given)
        assert e.value.status == 400 and e.value.param == "model_path"
        assert "outside" not in e.value.message
    with pytest.raises(OpenAIError, match="--allowed-weights-path DIR"):
        resolve_weights_path(None, "ckpt")


def test_key_file_roles_and_the_launchers_private_copy(tmp_path) -> None:
    path = tmp_path / "keys"
    path.write_text("k-1\nk-2 team\nk-3 role=admin\nk-4 ops role=admin\nk-5 team role=tenant\n")
    keys = parse_api_key_file(str(path))
    assert [(k.name, k.role) for k in keys] == [(None, TENANT), ("team", TENANT),
                                                (None, ADMIN), ("ops", ADMIN), ("team", TENANT)]
    for bad, says in [("k role=root\n", "role must be one of"),
                      ("k a b role=admin\n", "expected 'KEY'"),
                      ("k role=admin role=admin\n", "expected 'KEY'")]:
        path.write_text(bad)
        with pytest.raises(ValueError, match=says):
            parse_api_key_file(str(path))
    loaded = load_api_keys(["k-cli"], None, "k-env", ["k-admin"], "k-env-admin")
    assert [(k.key, k.role) for k in loaded.keys] == [("k-cli", TENANT), ("k-admin", ADMIN)]
    loaded = load_api_keys(None, None, "k-env", None, "k-env-admin")
    assert [(k.key, k.role) for k in loaded.keys] == [("k-env", TENANT),
                                                      ("k-env-admin", ADMIN)]
    with pytest.raises(ValueError, match="given twice"):
        load_api_keys(["k"], None, None, ["k"])
    copy = tmp_path / "copy"
    write_api_key_file(KEYS, str(copy))
    assert os.stat(copy).st_mode & 0o777 == 0o600
    assert [(k.key, k.name, k.role) for k in parse_api_key_file(str(copy))] == \
        [(TENANT_KEY, "team", TENANT), (ADMIN_KEY, "ops", ADMIN)]
    assert "with the admin role" in KEYS.describe() and ADMIN_KEY not in KEYS.describe()


def test_enable_admin_routes_with_keys_is_a_cli_error() -> None:
    r = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.openai.cli_serve",
                        "--api-key", "k", "--enable-admin-routes"], cwd=REPO,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "--enable-admin-routes is for a server without API keys" \
        in r.stderr, r.stderr
