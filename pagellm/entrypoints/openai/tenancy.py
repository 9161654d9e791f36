"""API keys and the tenant each one names: who may call the server, and whose prefix-cache
blocks a request may share (docs/serving.md, docs/prefix_caching.md).

Stdlib only: the replica proxy checks keys with the same code as the server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

# Paths that stay open when keys are configured (probes, scrapers and vllm-router's load poll
# carry no key).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/get_load", "/docs", "/openapi.json",
                        "/docs/oauth2-redirect", "/redoc"})
# The ASGI scope entry where the key middleware leaves the caller's tenant identity.
TENANT_SCOPE_KEY = "pagellm.tenant"
PREFIX_CACHE_SCOPES = ("key", "global")


@dataclass(frozen=True)
class ApiKey:
    key: str = field(repr=False)  # never printed, logged or hashed into the cache
    name: str | None = None

    @property
    def identity(self) -> str:
        """The tenant this key belongs to: its name, else a hash of the key (the key itself
        never leaves this object). Keys given one name are one tenant."""
        if self.name:
            return "name:" + self.name
        return "sha256:" + hashlib.sha256(self.key.encode()).hexdigest()[:32]


class ApiKeys:
    """The accepted keys. ``identity_of`` compares the whole Authorization header with every
    ``Bearer <key>`` in constant time (no early exit), so timing tells nothing of the keys
    beyond how many there are."""

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._expected = [(f"Bearer {k.key}".encode(), k.identity) for k in keys]
        self.names = sorted({k.name for k in keys if k.name})
        self.num_unnamed = sum(1 for k in keys if not k.name)

    def __len__(self) -> int:
        return len(self._expected)

    def identity_of(self, authorization: bytes) -> str | None:
        found = None
        for expected, identity in self._expected:
            if hmac.compare_digest(authorization, expected):
                found = identity
        return found

    def describe(self) -> str:
        """For the start-up log: counts and names, never a key."""
        parts = [f"tenant {name!r}" for name in self.names]
        if self.num_unnamed:
            parts.append(f"{self.num_unnamed} unnamed")
        return f"{len(self)} API key(s): " + ", ".join(parts)


def parse_api_key_file(path: str) -> list[ApiKey]:
    """``--api-key-file``: one key per line, optionally followed by a tenant name; blank lines
    and lines starting with ``#`` are skipped. Errors name the file and line, never a key."""
    where = f"--api-key-file {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it ({e.strerror or e}).") from None
    except UnicodeDecodeError:
        raise ValueError(f"{where}: the file is not UTF-8 text.") from None
    keys: list[ApiKey] = []
    first_line: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ValueError(f"{where}, line {n}: expected 'KEY' or 'KEY NAME', got "
                             f"{len(fields)} fields.")
        key = fields[0]
        if not (key.isascii() and key.isprintable()):
            raise ValueError(f"{where}, line {n}: a key must be printable ASCII (it travels "
                             "in an HTTP header).")
        if key in first_line:
            raise ValueError(f"{where}, line {n}: the key of line {first_line[key]} again.")
        first_line[key] = n
        keys.append(ApiKey(key, fields[1] if len(fields) == 2 else None))
    if not keys:
        raise ValueError(f"{where}: the file has no keys.")
    return keys


def load_api_keys(cli_keys: Sequence[str] | None, key_file: str | None,
                  env_key: str | None) -> ApiKeys | None:
    """Every ``--api-key`` and every key of ``--api-key-file``; PAGELLM_API_KEY only when
    neither flag is given (a flag replaces the environment, as before). None: no keys."""
    keys: list[ApiKey] = []
    for key in cli_keys or ():
        if not key:
            raise ValueError("--api-key must not be empty.")
        if key not in (k.key for k in keys):
            keys.append(ApiKey(key))
    if key_file:
        for k in parse_api_key_file(key_file):
            if any(k.key == other.key for other in keys):
                raise ValueError(f"--api-key-file {key_file}: a key of the file is also "
                                 "given with --api-key.")
            keys.append(k)
    if not keys and env_key:
        keys.append(ApiKey(env_key))
    return ApiKeys(keys) if keys else None


def cache_namespace(tenant: str | None, salt: str | None) -> str | None:
    """The cache salt the engine sees: the tenant's identity and the request's own salt, or
    the salt alone when there is no tenant (no keys, or --prefix-cache-scope global). JSON keeps
    the pair unambiguous: no salt of one tenant can spell another tenant's namespace."""
    if tenant is None:
        return salt
    return json.dumps([tenant, salt])
