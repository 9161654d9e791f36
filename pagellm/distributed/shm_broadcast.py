"""One writer, N readers: a ring of message slots in shared memory.

The engine pickles each step's message once and copies it into the ring; every worker reads it
from the same bytes (no per-reader pickle, no per-tensor pickle). A message larger than one slot
spans consecutive slots. Readers are woken by one POSIX semaphore each (no busy polling, which
would steal the cores the CPU ranks compute on), and wake up every ``poll_s`` to ask their
``should_stop`` callback whether to give up, so a worker never outlives its engine.

Layout of the shared block: ``num_slots`` headers of three int64 (sequence number of the chunk in
the slot, its length, 1 if more chunks of the same message follow), then one int64 cursor per
reader (how many chunks it has consumed), then the slots' bytes.

NOTE: the semaphore release/acquire pair orders the writer's stores before the reader's loads.
The writer reuses a slot only after every reader's cursor has passed it.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

_HEADER_FIELDS = 3  # seq, nbytes, more


@dataclass
class BroadcastHandle:
    """What a reader process needs to attach (picklable; pass it as a Process argument)."""

    name: str
    num_slots: int
    slot_bytes: int
    num_readers: int
    semaphores: list[Any]  # multiprocessing.Semaphore, one per reader


class BrokenBroadcastError(RuntimeError):
    """A peer is gone (``should_stop``/``check_alive`` said so) while waiting on the ring."""


class _Ring:
    def __init__(self, shm: shared_memory.SharedMemory, num_slots: int, slot_bytes: int,
                 num_readers: int) -> None:
        self.shm = shm
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        n_hdr = num_slots * _HEADER_FIELDS
        ints = np.ndarray((n_hdr + num_readers,), dtype=np.int64, buffer=shm.buf)
        self.headers = ints[:n_hdr].reshape(num_slots, _HEADER_FIELDS)
        self.cursors = ints[n_hdr:]
        self.data_offset = (n_hdr + num_readers) * 8

    def slot(self, index: int) -> memoryview:
        start = self.data_offset + index * self.slot_bytes
        return self.shm.buf[start : start + self.slot_bytes]

    @staticmethod
    def nbytes(num_slots: int, slot_bytes: int, num_readers: int) -> int:
        return (num_slots * _HEADER_FIELDS + num_readers) * 8 + num_slots * slot_bytes

    def release(self) -> None:
        # Views into shm.buf must go before the mapping can close.
        del self.headers, self.cursors
        self.shm.close()


class ShmBroadcastWriter:
    """The writer end; owns (and unlinks) the shared memory."""

    def __init__(self, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20) -> None:
        assert num_readers >= 1 and num_slots >= 2 and slot_bytes >= 64
        size = _Ring.nbytes(num_slots, slot_bytes, num_readers)
        shm = shared_memory.SharedMemory(create=True, size=size)
        self._ring = _Ring(shm, num_slots, slot_bytes, num_readers)
        self._ring.headers[:] = 0
        self._ring.cursors[:] = 0
        ctx = multiprocessing.get_context("spawn")
        self.handle = BroadcastHandle(shm.name, num_slots, slot_bytes, num_readers,
                                      [ctx.Semaphore(0) for _ in range(num_readers)])
        self._next_seq = 0  # chunks written so far
        self._closed = False

    def enqueue(self, obj: Any, check_alive: Callable[[], None] | None = None) -> int:
        """Pickle ``obj`` once and publish it to every reader; returns its size in bytes.

        Blocks only while the ring is full (a message larger than the whole ring, or readers
        that are behind), calling ``check_alive`` (which should raise) while it waits.
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        ring = self._ring
        view = memoryview(data)
        offset = 0
        while True:
            chunk = view[offset : offset + ring.slot_bytes]
            offset += len(chunk)
            more = offset < len(data)
            self._wait_free_slot(check_alive)
            index = self._next_seq % ring.num_slots
            ring.slot(index)[: len(chunk)] = chunk
            hdr = ring.headers[index]
            hdr[1] = len(chunk)
            hdr[2] = int(more)
            hdr[0] = self._next_seq + 1  # published last
            self._next_seq += 1
            for sem in self.handle.semaphores:
                sem.release()
            if not more:
                return len(data)

    def _wait_free_slot(self, check_alive: Callable[[], None] | None) -> None:
        # The slot to reuse held chunk next_seq - num_slots: every reader must be past it.
        oldest_needed = self._next_seq - self._ring.num_slots + 1
        delay = 1e-5
        while int(self._ring.cursors.min()) < oldest_needed:
            if check_alive is not None:
                check_alive()
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)

    def close(self) -> None:
        """Unmap and unlink the shared memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        shm = self._ring.shm
        self._ring.release()
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


class ShmBroadcastReader:
    """Reader ``rank`` of a broadcast, attached in its own process."""

    def __init__(self, handle: BroadcastHandle, rank: int) -> None:
        assert 0 <= rank < handle.num_readers
        shm = shared_memory.SharedMemory(name=handle.name)
        self._ring = _Ring(shm, handle.num_slots, handle.slot_bytes, handle.num_readers)
        self._sem = handle.semaphores[rank]
        self._rank = rank
        self._seq = int(self._ring.cursors[rank])

    def dequeue(self, should_stop: Callable[[], bool] | None = None,
                poll_s: float = 1.0) -> Any:
        """The next message, in order. Raises BrokenBroadcastError once ``should_stop()`` is
        true while waiting (checked every ``poll_s`` seconds)."""
        ring = self._ring
        parts: list[bytes] = []
        while True:
            while not self._sem.acquire(timeout=poll_s):
                if should_stop is not None and should_stop():
                    raise BrokenBroadcastError("the broadcast writer is gone")
            index = self._seq % ring.num_slots
            seq, nbytes, more = (int(v) for v in ring.headers[index])
            assert seq == self._seq + 1, (seq, self._seq)
            slot = ring.slot(index)
            if not more and not parts:
                obj = pickle.loads(slot[:nbytes])  # straight from shared memory
                self._advance()
                return obj
            parts.append(bytes(slot[:nbytes]))
            self._advance()
            if not more:
                return pickle.loads(b"".join(parts))

    def _advance(self) -> None:
        self._seq += 1
        self._ring.cursors[self._rank] = self._seq

    def close(self) -> None:
        self._ring.release()
