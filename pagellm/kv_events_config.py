"""``--kv-events-config``: publishing KV cache events over ZMQ (vLLM's KVEventsConfig keys).

Given as a JSON object on the command line, or a dict (or JSON string) to ``LLM(...)``::

    {"enable_kv_cache_events": true, "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}

Pure Python (engine_args checks it without importing zmq); engine/kv_events.py publishes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from pagellm.config_flags import json_object_flag

FLAG = "--kv-events-config"
PUBLISHERS = ("zmq", "null")
_SCHEMES = ("tcp://", "ipc://", "inproc://")
_TCP_PORT = re.compile(r":(\d{1,5})$")


@dataclass(frozen=True)
class KVEventsConfig:
    """A checked KV events setup (build it with ``parse_kv_events_config``); vLLM's defaults."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null" (vLLM's rule).
    publisher: str | None = None
    # The PUB socket: bound when it has "*" or "::" or is ipc/inproc, else connected to.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # ROUTER socket (always bound); None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (0: unlimited)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped
    topic: str = ""

    @property
    def active(self) -> bool:
        """Events are recorded and published (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_KEYS = tuple(f.name for f in fields(KVEventsConfig))


def _error(key: str, message: str) -> ValueError:
    return ValueError(f"{FLAG}: {key!r} {message}")


def _int(raw: dict[str, Any], key: str, minimum: int) -> None:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(key, f"must be an integer, got {value!r}.")
    if value < minimum:
        raise _error(key, f"must be >= {minimum}, got {value}.")


def _endpoint(raw: dict[str, Any], key: str) -> None:
    value = raw[key]
    if not isinstance(value, str) or not value.startswith(_SCHEMES):
        raise _error(key, f"must be a ZMQ endpoint ({', '.join(s + '...' for s in _SCHEMES)}), "
                     f"got {value!r}.")
    if value.startswith("tcp://"):
        port = _TCP_PORT.search(value)
        if port is None or not 0 < int(port.group(1)) < 65536:
            raise _error(key, f"needs a port (tcp://HOST:PORT, e.g. tcp://*:5557), got "
                         f"{value!r}.")


def parse_kv_events_config(value: Any) -> KVEventsConfig | None:
    """The KVEventsConfig of a JSON string, a dict, or an already parsed config; None for None
    or an empty string. ValueError, naming ``--kv-events-config`` and the key, on unknown keys
    and wrong types or values."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    value = json_object_flag(value, FLAG, _KEYS, '{"enable_kv_cache_events": true}')
    if value is None:
        return None
    raw = dict(value)
    if not isinstance(raw.get("enable_kv_cache_events", False), bool):
        raise _error("enable_kv_cache_events",
                     f"must be true or false, got {raw['enable_kv_cache_events']!r}.")
    publisher = raw.get("publisher")
    if publisher is not None and publisher not in PUBLISHERS:
        raise _error("publisher", f"must be one of {', '.join(PUBLISHERS)}, got {publisher!r}.")
    if "endpoint" in raw:
        _endpoint(raw, "endpoint")
    if raw.get("replay_endpoint") is not None:
        _endpoint(raw, "replay_endpoint")
    for key, minimum in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
        if key in raw:
            _int(raw, key, minimum)
    if not isinstance(raw.get("topic", ""), str):
        raise _error("topic", f"must be a string, got {raw['topic']!r}.")
    if publisher is None:
        raw["publisher"] = "zmq" if raw.get("enable_kv_cache_events", False) else "null"
    return KVEventsConfig(**raw)


def check_kv_events_combination(config: KVEventsConfig | None,
                                enable_prefix_caching: bool) -> None:
    """Events describe the prefix cache: refuse them without one (vLLM only warns, and then
    publishes nothing)."""
    if config is not None and config.active and not enable_prefix_caching:
        raise ValueError(f"{FLAG}: 'enable_kv_cache_events' needs --enable-prefix-caching (the "
                         "events report the prefix cache's blocks).")
