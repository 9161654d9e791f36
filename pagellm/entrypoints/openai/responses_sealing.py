"""``include: ["reasoning.encrypted_content"]``: reasoning items carry an opaque value that a
client resends in a later request's ``input`` (stateless multi-turn, ``store`` false), and the
server reads the reasoning back from it.

The value is the reasoning text signed with HMAC-SHA256 under a key drawn at start-up and bound
to the caller's tenant: another tenant's value, one altered in any byte, or one from before a
restart is a 400 naming the item. It is signed, not encrypted: the standard library has no
cipher, and the same response already shows the client the text (the item's ``content``), so
what matters is that nobody can hand the server reasoning it did not write, or another
tenant's. Format: ``pgr1.<base64url text>.<base64url tag>``."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

_VERSION = "pgr1"
_DOMAIN = b"pagellm responses reasoning v1\x00"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ReasoningSealer:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)

    def _tag(self, tenant: str, text: bytes) -> bytes:
        tenant_hash = hashlib.sha256(tenant.encode()).digest()
        return hmac.new(self._key, _DOMAIN + tenant_hash + text, hashlib.sha256).digest()

    def seal(self, tenant: str, text: str) -> str:
        data = text.encode()
        return f"{_VERSION}.{_b64(data)}.{_b64(self._tag(tenant, data))}"

    def open(self, tenant: str, value: str) -> str | None:
        """The reasoning text ``value`` carries, or None when this server did not seal it for
        ``tenant`` (another tenant's, altered, malformed, or sealed before a restart)."""
        parts = value.split(".") if isinstance(value, str) else []
        if len(parts) != 3 or parts[0] != _VERSION:
            return None
        try:
            data, tag = _unb64(parts[1]), _unb64(parts[2])
        except (binascii.Error, ValueError):
            return None
        if not hmac.compare_digest(tag, self._tag(tenant, data)):
            return None
        try:
            return data.decode()
        except UnicodeDecodeError:  # cannot happen for a value we signed
            return None
