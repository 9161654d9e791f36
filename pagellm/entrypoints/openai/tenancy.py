"""API keys, the tenant each one names and its role: who may call the server, whose prefix-cache
blocks a request may share (docs/serving.md, docs/prefix_caching.md), and who may run the admin
routes that act for every tenant (docs/reliability.md, "Admin routes").

Stdlib only: the replicas launcher reads keys with the same code as the server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

# Paths that stay open when keys are configured (probes, scrapers and vllm-router's load poll
# carry no key).
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/get_load", "/docs", "/openapi.json",
                        "/docs/oauth2-redirect", "/redoc"})
# Routes that act for every tenant (weights, sleep, the shared prefix cache): an admin key's
# only (403 for a tenant key); with no key configured, off unless --enable-admin-routes.
ADMIN_PATHS = frozenset({"/update_weights_from_disk", "/sleep", "/wake_up", "/is_sleeping",
                         "/reset_prefix_cache"})
# The ASGI scope entries where the key middleware leaves the caller's tenant identity and role.
TENANT_SCOPE_KEY = "pagellm.tenant"
ROLE_SCOPE_KEY = "pagellm.role"
PREFIX_CACHE_SCOPES = ("key", "global")
TENANT, ADMIN = "tenant", "admin"
ROLES = (TENANT, ADMIN)
_ROLE_FIELD = "role="


@dataclass(frozen=True)
class ApiKey:
    key: str = field(repr=False)  # never printed, logged or hashed into the cache
    name: str | None = None
    role: str = TENANT

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"an API key's role must be one of {', '.join(ROLES)}, got "
                             f"{self.role!r}")

    @property
    def identity(self) -> str:
        """The tenant this key belongs to: its name, else a hash of the key (the key itself
        never leaves this object). Keys given one name are one tenant."""
        if self.name:
            return "name:" + self.name
        return "sha256:" + hashlib.sha256(self.key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant (cache namespace) and role of the key it carried."""
    identity: str
    role: str


class ApiKeys:
    """The accepted keys. ``caller_of`` compares the whole Authorization header with every
    ``Bearer <key>`` in constant time (no early exit), so timing tells nothing of the keys
    beyond how many there are."""

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self.keys = list(keys)  # for a launcher handing them on (write_api_key_file)
        self._expected = [(f"Bearer {k.key}".encode(), Caller(k.identity, k.role))
                          for k in keys]
        self.names = sorted({k.name for k in keys if k.name})
        self.num_unnamed = sum(1 for k in keys if not k.name)
        self.num_admin = sum(1 for k in keys if k.role == ADMIN)

    def __len__(self) -> int:
        return len(self._expected)

    def caller_of(self, authorization: bytes) -> Caller | None:
        found = None
        for expected, caller in self._expected:
            if hmac.compare_digest(authorization, expected):
                found = caller
        return found

    def describe(self) -> str:
        """For the start-up log: counts and names, never a key."""
        parts = [f"tenant {name!r}" for name in self.names]
        if self.num_unnamed:
            parts.append(f"{self.num_unnamed} unnamed")
        admins = f"; {self.num_admin} with the admin role" if self.num_admin else \
            "; none with the admin role (admin routes answer 403)"
        return f"{len(self)} API key(s): " + ", ".join(parts) + admins


def parse_api_key_file(path: str) -> list[ApiKey]:
    """``--api-key-file``: one key per line, optionally followed by a tenant name and then by
    ``role=admin`` (or ``role=tenant``, the default); blank lines and lines starting with ``#``
    are skipped. Errors name the file and line, never a key."""
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
        role = TENANT
        if len(fields) > 1 and fields[-1].startswith(_ROLE_FIELD):
            role = fields.pop()[len(_ROLE_FIELD):]
            if role not in ROLES:
                raise ValueError(f"{where}, line {n}: the role must be one of "
                                 f"{', '.join(ROLES)}, got {role!r}.")
        if len(fields) > 2 or (len(fields) == 2 and fields[1].startswith(_ROLE_FIELD)):
            raise ValueError(f"{where}, line {n}: expected 'KEY', 'KEY NAME', 'KEY role=ROLE' "
                             "or 'KEY NAME role=ROLE'.")
        key = fields[0]
        if not (key.isascii() and key.isprintable()):
            raise ValueError(f"{where}, line {n}: a key must be printable ASCII (it travels "
                             "in an HTTP header).")
        if key in first_line:
            raise ValueError(f"{where}, line {n}: the key of line {first_line[key]} again.")
        first_line[key] = n
        keys.append(ApiKey(key, fields[1] if len(fields) == 2 else None, role))
    if not keys:
        raise ValueError(f"{where}: the file has no keys.")
    return keys


def load_api_keys(cli_keys: Sequence[str] | None, key_file: str | None,
                  env_key: str | None, admin_keys: Sequence[str] | None = None,
                  env_admin_key: str | None = None) -> ApiKeys | None:
    """Every ``--api-key``, ``--admin-api-key`` and key of ``--api-key-file``; PAGELLM_API_KEY
    only when neither ``--api-key`` nor ``--api-key-file`` is given, PAGELLM_ADMIN_API_KEY only
    when no flag gives an admin key (a flag replaces the environment). None: no keys."""
    keys: list[ApiKey] = []

    def add(key: ApiKey, where: str) -> None:
        if not key.key:
            raise ValueError(f"{where} must not be empty.")
        if any(key.key == other.key for other in keys):
            raise ValueError(f"{where}: a key is given twice (each key has one role).")
        keys.append(key)

    for key in dict.fromkeys(cli_keys or ()):
        add(ApiKey(key), "--api-key")
    for key in dict.fromkeys(admin_keys or ()):
        add(ApiKey(key, role=ADMIN), "--admin-api-key")
    if key_file:
        for k in parse_api_key_file(key_file):
            add(k, f"--api-key-file {key_file}")
    if not cli_keys and not key_file and env_key:
        add(ApiKey(env_key), "PAGELLM_API_KEY")
    if env_admin_key and not any(k.role == ADMIN for k in keys):
        add(ApiKey(env_admin_key, role=ADMIN), "PAGELLM_ADMIN_API_KEY")
    return ApiKeys(keys) if keys else None


def write_api_key_file(keys: ApiKeys, path: str) -> None:
    """Write ``keys`` (names and roles kept) as an ``--api-key-file`` readable by this user
    only: how a launcher hands keys to the servers it starts (never on a command line, which
    ``ps`` shows to every user)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for k in keys.keys:
            f.write(" ".join([k.key, *([k.name] if k.name else []), _ROLE_FIELD + k.role])
                    + "\n")


def cache_namespace(tenant: str | None, salt: str | None) -> str | None:
    """The cache salt the engine sees: the tenant's identity and the request's own salt, or
    the salt alone when there is no tenant (no keys, or --prefix-cache-scope global). JSON keeps
    the pair unambiguous: no salt of one tenant can spell another tenant's namespace."""
    if tenant is None:
        return salt
    return json.dumps([tenant, salt])
