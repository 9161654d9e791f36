"""The responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory,
per tenant (a response stored under one API key does not exist for another), and bounded per
tenant by count, total bytes and age (--max-stored-responses, --max-stored-response-bytes,
--stored-response-ttl); a tenant's oldest go first, and no tenant's traffic evicts another's.
The whole store holds at most the bounds times the number of API keys. vLLM's store has no
bound."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagellm.entrypoints.openai.responses_input import dumps_size

DEFAULT_MAX_STORED_RESPONSES = 1000
DEFAULT_MAX_STORED_RESPONSE_BYTES = 64 * 1024 * 1024
DEFAULT_STORED_RESPONSE_TTL_S = 3600.0


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET answers it
    # This turn's conversation as chat messages (earlier turns, the input, the output): what a
    # follow-up's previous_response_id puts before its own input.
    conversation: list[dict[str, Any]]
    cancel: Callable[[], None] | None = None  # while in progress: stops the generation
    size: int = field(default=0, init=False)
    stored_at: float = field(default=0.0, init=False)
    # Set when DELETE removed it: a response deleted while it ran is not stored when it ends.
    deleted: bool = field(default=False, init=False)

    @property
    def in_progress(self) -> bool:
        return self.response.get("status") == "in_progress"


@dataclass
class _Shelf:
    """One tenant's responses, oldest first, and their bytes."""

    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    num_bytes: int = 0


class ResponseStore:
    """``max_entries`` 0 keeps nothing. ``clock``: monotonic seconds (a fake one in tests).
    The bounds hold for each tenant."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES,
                 ttl_s: float = DEFAULT_STORED_RESPONSE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0 or max_bytes < 0 or ttl_s <= 0:
            raise ValueError("--max-stored-responses and --max-stored-response-bytes must be "
                             ">= 0 and --stored-response-ttl > 0.")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self._shelves: dict[str, _Shelf] = {}

    def __len__(self) -> int:
        return sum(len(shelf.entries) for shelf in self._shelves.values())

    @property
    def num_bytes(self) -> int:
        return sum(shelf.num_bytes for shelf in self._shelves.values())

    def describe_bounds(self) -> str:
        return (f"the store keeps at most {self.max_entries} responses "
                f"(--max-stored-responses), {self.max_bytes} bytes "
                f"(--max-stored-response-bytes) per API key, each for {self.ttl_s:g} s "
                "(--stored-response-ttl)")

    def put(self, tenant: str, record: StoredResponse) -> bool:
        """Store (or replace) ``record`` under its response id; False when it alone is over the
        bounds (nothing is kept then, and an older version of it is dropped)."""
        response_id = record.response["id"]
        self._drop(tenant, response_id)
        record.size = dumps_size([record.response, record.conversation])
        if self.max_entries == 0 or record.size > self.max_bytes:
            return False
        record.stored_at = self.clock()
        shelf = self._shelves.setdefault(tenant, _Shelf())
        shelf.entries[response_id] = record
        shelf.num_bytes += record.size
        self._evict(tenant, shelf)
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        shelf = self._shelves.get(tenant)
        if shelf is None:
            return None
        self._expire(tenant, shelf)
        return shelf.entries.get(response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        if self.get(tenant, response_id) is None:
            return False
        record = self._shelves[tenant].entries[response_id]
        record.deleted = True
        return self._drop(tenant, response_id)

    def _drop(self, tenant: str, response_id: str) -> bool:
        shelf = self._shelves.get(tenant)
        record = shelf.entries.pop(response_id, None) if shelf is not None else None
        if record is None:
            return False
        shelf.num_bytes -= record.size
        if not shelf.entries:
            del self._shelves[tenant]  # no empty shelf per key ever seen
        return True

    def _expire(self, tenant: str, shelf: _Shelf) -> None:
        deadline = self.clock() - self.ttl_s
        while shelf.entries:
            response_id, oldest = next(iter(shelf.entries.items()))
            if oldest.stored_at > deadline:
                break
            self._drop(tenant, response_id)

    def _evict(self, tenant: str, shelf: _Shelf) -> None:
        self._expire(tenant, shelf)
        while shelf.entries and (len(shelf.entries) > self.max_entries
                                 or shelf.num_bytes > self.max_bytes):
            self._drop(tenant, next(iter(shelf.entries)))
