"""API keys without a model: --api-key-file parsing (names, comments, bad lines as a clear CLI
error), where keys come from, the constant-time check over several keys, and the cache
namespace a key's tenant gets."""

from __future__ import annotations

import subprocess
import sys

import pytest
from server_utils import REPO

from pagellm.entrypoints.openai import tenancy
from pagellm.entrypoints.openai.tenancy import (
    ApiKey,
    ApiKeys,
    cache_namespace,
    load_api_keys,
    parse_api_key_file,
)

SECRET = "sk-secret-never-shown-4242"


def identity_of(keys: ApiKeys, header: bytes) -> str | None:
    caller = keys.caller_of(header)
    return None if caller is None else caller.identity


def write(tmp_path, text: str) -> str:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return str(path)


def test_key_file_names_comments_and_blank_lines(tmp_path):
    path = write(tmp_path, "# operator's keys\n\n  k-alpha   team-a  \nk-beta team-a\n"
                           "\t# indented comment\nk-gamma\n\n")
    keys = parse_api_key_file(path)
    assert [(k.key, k.name) for k in keys] == [("k-alpha", "team-a"), ("k-beta", "team-a"),
                                               ("k-gamma", None)]
    # Keys with one name are one tenant; an unnamed key is its own, named by a hash.
    assert keys[0].identity == keys[1].identity == "name:team-a"
    assert keys[2].identity.startswith("sha256:") and "k-gamma" not in keys[2].identity
    assert "k-gamma" not in repr(keys[2])
    api_keys = ApiKeys(keys)
    assert identity_of(api_keys, b"Bearer k-beta") == "name:team-a"
    assert identity_of(api_keys, b"Bearer k-gamma") == keys[2].identity
    assert identity_of(api_keys, b"Bearer k-delta") is None
    assert identity_of(api_keys, b"k-alpha") is None
    described = api_keys.describe()
    assert "team-a" in described and not any(k.key in described for k in keys)


@pytest.mark.parametrize("text, line, says", [
    ("k1\nk2 name extra\n", 2, "expected 'KEY', 'KEY NAME'"),
    (f"{SECRET} a\n{SECRET} b\n", 2, "the key of line 1 again"),
    ("# only comments\n\n", None, "has no keys"),
    (f"ok\n{SECRET}\u00e9 x\n", 2, "printable ASCII"),
])
def test_bad_key_files_name_the_flag_and_line_never_a_key(tmp_path, text, line, says):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        parse_api_key_file(path)
    message = str(e.value)
    assert message.startswith(f"--api-key-file {path}") and says in message
    assert line is None or f"line {line}:" in message
    assert SECRET not in message
    with pytest.raises(ValueError, match="cannot read"):
        parse_api_key_file(str(tmp_path / "missing"))


def test_where_keys_come_from(tmp_path):
    path = write(tmp_path, "k-file named\n")
    keys = load_api_keys(["k1", "k2", "k1"], path, env_key="k-env")
    assert len(keys) == 3  # the flags; the environment only without them
    assert identity_of(keys, b"Bearer k-env") is None
    assert identity_of(keys, b"Bearer k-file") == "name:named"
    assert len(load_api_keys(None, None, "k-env")) == 1
    assert load_api_keys(None, None, None) is None
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        load_api_keys([""], None, None)
    with pytest.raises(ValueError, match="a key is given twice"):
        load_api_keys(["k-file"], path, None)


def test_every_key_is_compared_in_constant_time(monkeypatch):
    """Each check compares the whole header with every key, whichever matches (or none)."""
    calls = []
    real = tenancy.hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tenancy.hmac, "compare_digest", recording)
    keys = ApiKeys([ApiKey("k1", "one"), ApiKey("k2"), ApiKey("k3", "three")])
    for header, identity in ((b"Bearer k1", "name:one"), (b"Bearer k3", "name:three"),
                             (b"Bearer k", None), (b"", None)):
        calls.clear()
        assert identity_of(keys, header) == identity
        assert calls == [(header, f"Bearer k{i}".encode()) for i in (1, 2, 3)]


def test_cache_namespace_composes_tenant_and_salt():
    assert cache_namespace(None, None) is None  # no keys (or scope global): as before
    assert cache_namespace(None, "s") == "s"
    spaces = {cache_namespace(t, s) for t in ("name:a", "name:b", "name:a\", \"x")
              for s in (None, "s", "x\"]", "\", \"s")}
    assert len(spaces) == 12  # no tenant's salt spells another namespace
    assert all(ns is not None and ns != "s" for ns in spaces)


def test_a_bad_key_file_is_a_cli_error(tmp_path):
    path = write(tmp_path, f"# keys\n{SECRET} team-a trailing\n")
    r = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.openai.cli_serve",
                        "--api-key-file", path, "--dtype", "float32"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert f"error: --api-key-file {path}, line 2:" in r.stderr
    assert SECRET not in r.stderr + r.stdout
