"""Publishing the block pool's KV cache events over ZMQ, on vLLM's wire (--kv-events-config).

After each engine step the events drained from the block pool go out as one batch, so a
subscriber (llm-d's precise prefix-aware routing, vLLM's kv_events_subscriber example) can keep
the engine's set of cached block hashes.

Wire format (vLLM's msgspec structs, array-like with tagged events), msgpack-encoded:

    batch:  [ts, [event, ...], data_parallel_rank]
    event:  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
             medium, lora_name]
            ["BlockRemoved", block_hashes, medium]
            ["AllBlocksCleared"]

Block hashes are those of core/block_hash.py, the same in every process for the same tokens,
sent as vLLM sends them by default: the digest's last 8 bytes as a big-endian unsigned 64-bit
integer (``external_block_hash``), or the whole 32-byte digest (msgpack bin) with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``. On the PUB socket each batch is a multipart message
``[topic, seq (8-byte big-endian), payload]``, seq counting batches from 0. The ROUTER replay
socket answers a request whose last frame is a start seq (8-byte big-endian) with every buffered
batch from it on, ``[seq, payload]`` each, then ``[-1 (8 bytes, signed), b""]``.

The engine thread only enqueues; a background thread encodes and sends. When the queue is full
(``max_queue_size`` batches) a batch is dropped with a warning rather than stalling the step;
its seq is used up, so subscribers see the gap.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from pagellm.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagellm.kv_events_config import FLAG, KVEventsConfig

logger = logging.getLogger("pagellm")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
_POLL_S = 0.05  # how long the thread waits for a batch before it looks at the replay socket
_SHUTDOWN_S = 2.0


def data_parallel_rank(config: Any) -> int:
    """The engine's data-parallel rank (its engine index): the one place it is read. 0 until
    ParallelConfig carries one."""
    return int(getattr(config.parallel, "data_parallel_rank", 0) or 0)


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of data-parallel rank ``rank`` (vLLM's rule): tcp ports move up by the
    rank, inproc names get ``_dp<rank>``; rank 0 keeps the endpoint as given."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"{FLAG}: with data parallelism the endpoints must be tcp:// or "
                     f"inproc:// (each rank needs its own), got {endpoint!r}.")


_U64 = (1 << 64) - 1


def external_block_hash(block_hash: bytes, as_int: bool) -> bytes | int:
    """A block hash as the events carry it (vLLM's rule: the low 64 bits of the big-endian
    digest, or the digest itself)."""
    return int.from_bytes(block_hash, "big") & _U64 if as_int else block_hash


def _wire_event(event: KVCacheEvent, int_hashes: bool) -> list[Any]:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return ["BlockStored", [external_block_hash(h, int_hashes) for h in event.block_hashes],
                None if parent is None else external_block_hash(parent, int_hashes),
                event.token_ids, event.block_size, event.lora_id, event.medium, event.lora_name]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [external_block_hash(h, int_hashes) for h in event.block_hashes],
                event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(ts: float, events: Sequence[KVCacheEvent], rank: int,
                 int_hashes: bool = True) -> bytes:
    """One KVEventBatch as vLLM's msgspec encoder writes it."""
    return msgpack.packb([float(ts), [_wire_event(e, int_hashes) for e in events], rank],
                         use_bin_type=True)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or local transport is bound, anything else connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket plus an optional ROUTER replay socket, served by one background thread.

    The sockets are bound in the constructor, so a busy port fails the engine's start-up with
    an error naming the flag; from then on only the thread touches them."""

    def __init__(self, config: KVEventsConfig, rank: int = 0,
                 ctx: zmq.Context | None = None, int_hashes: bool = True) -> None:
        self.rank = rank
        self.int_hashes = int_hashes
        self.endpoint = offset_endpoint_port(config.endpoint, rank)
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, rank)
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[int, float, list[KVCacheEvent]] | None] = queue.Queue(
            maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            assert self.endpoint is not None
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"{FLAG}: cannot open the sockets ({e}): endpoint "
                             f"{self.endpoint!r}, replay_endpoint {self.replay_endpoint!r}."
                             ) from None
        self._thread = threading.Thread(target=self._run, name="pagellm-kv-events",
                                        daemon=True)
        self._thread.start()
        logger.info("Publishing KV cache events on %s%s", self.endpoint,
                    f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    @property
    def next_seq(self) -> int:
        """The seq the next batch gets: the batches published so far (dropped ones too)."""
        return self._next_seq

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (the engine thread; never blocks)."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: the publisher queue is full (max_queue_size %d); "
                               "batch %d dropped (%d so far)", self._queue.maxsize, seq,
                               self.num_dropped)

    def shutdown(self) -> None:
        """Send what is queued, stop the thread and close the sockets (idempotent)."""
        if not self._thread.is_alive():
            self._close_sockets()
            return
        try:
            self._queue.put(None, timeout=_SHUTDOWN_S)
        except queue.Full:
            logger.warning("KV events: the publisher did not drain its queue; closing anyway")
        self._thread.join(_SHUTDOWN_S)
        if self._thread.is_alive():  # its sockets are still in use: leave them to the exit
            logger.warning("KV events: the publisher thread did not stop in %.0f s", _SHUTDOWN_S)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=200)  # a subscriber still gets the last batches
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError as e:
                    logger.warning("KV events: replay request failed: %s", e)
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = encode_batch(ts, events, self.rank, self.int_hashes)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                # A broken batch must not stop the stream; its seq stays a gap.
                logger.exception("KV events: publishing batch %d failed", seq)
                continue
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        # [identity, b"", start] from REQ (or DEALER sending b"" first); [identity, start] too.
        if len(frames) < 2 or len(frames[-1]) != 8:
            logger.warning("KV events: ignoring a malformed replay request (%d frames)",
                           len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[-1], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))


def kv_events_enabled(config: Any) -> bool:
    """Whether an engine with this EngineConfig records and publishes KV cache events (off,
    or the "null" publisher: nothing is recorded then either)."""
    kv_events = config.kv_events_config
    return kv_events is not None and kv_events.active


def make_publisher(config: Any) -> ZmqEventPublisher | None:
    """The publisher an engine with this EngineConfig runs, or None (``kv_events_enabled``)."""
    if not kv_events_enabled(config):
        return None
    return ZmqEventPublisher(config.kv_events_config, data_parallel_rank(config),
                             int_hashes=config.env.kv_events_int_block_hashes)
