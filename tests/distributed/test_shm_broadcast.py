"""The shared-memory broadcast: every reader gets every message, in order, whatever its size
(one slot, many slots, more than the whole ring), and a dead peer is reported, not waited on."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time

import pytest

from pagellm.distributed.shm_broadcast import (
    BrokenBroadcastError,
    ShmBroadcastReader,
    ShmBroadcastWriter,
)

SLOT = 256
SLOTS = 4  # a ring of 1 KiB: messages of 5 KiB must stream through it


def _messages() -> list[object]:
    out: list[object] = []
    for i in range(60):
        size = (0, 10, SLOT - 40, SLOT, 3 * SLOT + 7, 5 * SLOT * SLOTS)[i % 6]
        out.append({"i": i, "payload": bytes((i + k) % 251 for k in range(size))})
    out.append("stop")
    return out


def _read_all(handle, rank: int, out_path: str, parent: int) -> None:
    reader = ShmBroadcastReader(handle, rank)
    got = []
    while True:
        msg = reader.dequeue(should_stop=lambda: os.getppid() != parent, poll_s=0.2)
        if rank == 1 and len(got) % 7 == 0:
            time.sleep(0.01)  # a slow reader: the writer must wait for it, not overwrite
        got.append(msg)
        if msg == "stop":
            break
    reader.close()
    with open(out_path, "wb") as f:
        pickle.dump(got, f)


def test_every_reader_gets_every_message_in_order(tmp_path) -> None:
    writer = ShmBroadcastWriter(num_readers=2, num_slots=SLOTS, slot_bytes=SLOT)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_read_all, daemon=True,
                         args=(writer.handle, r, str(tmp_path / f"r{r}.pkl"), os.getpid()))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        sent = _messages()
        sizes = [writer.enqueue(m) for m in sent]
        assert max(sizes) > SLOT * SLOTS  # at least one message larger than the ring
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        writer.close()
    for r in range(2):
        with open(tmp_path / f"r{r}.pkl", "rb") as f:
            assert pickle.load(f) == sent


def _read_one_then_die(handle) -> None:
    reader = ShmBroadcastReader(handle, 0)
    reader.dequeue()
    os._exit(3)


def test_writer_reports_a_dead_reader_instead_of_waiting() -> None:
    writer = ShmBroadcastWriter(num_readers=1, num_slots=2, slot_bytes=64)
    proc = multiprocessing.get_context("spawn").Process(target=_read_one_then_die,
                                                        args=(writer.handle,), daemon=True)
    try:
        proc.start()
        writer.enqueue("first")
        proc.join(120)
        assert proc.exitcode == 3

        def check_alive() -> None:
            if not proc.is_alive():
                raise BrokenBroadcastError("reader 0 is dead")

        # Two slots: one more message fits, the next needs the dead reader to move on.
        writer.enqueue("x", check_alive)
        start = time.monotonic()
        with pytest.raises(BrokenBroadcastError, match="reader 0 is dead"):
            writer.enqueue(b"y" * 200, check_alive)
        assert time.monotonic() - start < 5
    finally:
        writer.close()


def test_reader_gives_up_when_told_to_stop() -> None:
    writer = ShmBroadcastWriter(num_readers=1, num_slots=2, slot_bytes=64)
    reader = ShmBroadcastReader(writer.handle, 0)
    try:
        writer.enqueue(["a", 1])
        assert reader.dequeue() == ["a", 1]
        calls = []
        start = time.monotonic()
        with pytest.raises(BrokenBroadcastError):
            reader.dequeue(should_stop=lambda: calls.append(1) or len(calls) >= 3, poll_s=0.05)
        assert len(calls) == 3 and time.monotonic() - start < 5
    finally:
        reader.close()
        writer.close()
