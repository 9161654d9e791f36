"""--kv-events-config end to end: an engine with prefix caching publishes its block pool's events
over ZMQ; an independent subscriber (pyzmq + plain msgpack, and msgspec structs declared as
vLLM declares them) rebuilds the set of cached hashes, which must equal the pool's own map, with
hashes that core/block_hash.py gives for the prompts' tokens, consecutive seqs, and a replay
socket that returns the buffered batches."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from pagellm import LLM, SamplingParams
from pagellm.config import read_env
from pagellm.core.block_hash import extend_block_hashes, get_hash_fn
from pagellm.core.kv_events import BlockRemoved as PoolBlockRemoved
from pagellm.core.kv_events import BlockStored as PoolBlockStored
from pagellm.engine.kv_events import encode_batch, external_block_hash, offset_endpoint_port
from pagellm.engine_args import EngineArgs
from pagellm.kv_events_config import KVEventsConfig, parse_kv_events_config

BLOCK_SIZE = 16
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# vLLM's structs (vllm/distributed/kv_events.py), to decode the way its subscribers do.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    """SUB on the events, DEALER on the replay socket; keeps every batch by seq."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.topic = topic.encode()
        self.live: dict[int, bytes] = {}  # seq -> payload, as the PUB socket delivered them
        # Batches sent before the SUB's subscription reached the publisher (ZMQ's slow joiner)
        # never arrive live: the replay socket fills them.
        self.replayed: dict[int, bytes] = {}

    def receive_until(self, last_seq: int, timeout_ms: int = 20_000) -> bool:
        """Read live batches until ``last_seq``; False when none came for ``timeout_ms``."""
        while not self.live or max(self.live) < last_seq:
            if not self.sub.poll(timeout_ms):
                return False
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            self.live[int.from_bytes(seq, "big")] = payload
        return True

    def batch(self, seq: int) -> bytes:
        return self.live[seq] if seq in self.live else self.replayed[seq]

    def request_replay(self, start: int) -> list[tuple[int, bytes]]:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])  # as a REQ socket would
        out = []
        while True:
            assert self.replay.poll(20_000), "the replay socket did not answer"
            empty, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.ctx.term()


def wire(block_hash: bytes) -> int:
    """vLLM's default wire form of a block hash: the digest's low 64 bits, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


def apply(hashes: set[int], stored: dict[int, list[int]], payload: bytes) -> int:
    """Apply one batch decoded with plain msgpack (no schema): tagged arrays. Returns how many
    hashes it removed."""
    num_removed = 0
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and rank == 0
    for event in events:
        tag = event[0]
        if tag == "BlockStored":
            _, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name = event
            assert block_size == BLOCK_SIZE and medium == "GPU"
            assert lora_id is None and lora_name is None
            assert len(token_ids) == BLOCK_SIZE * len(block_hashes)
            assert parent is None or isinstance(parent, int)
            for k, h in enumerate(block_hashes):
                assert isinstance(h, int) and 0 <= h < 2**64 and h not in hashes
                hashes.add(h)
                stored[h] = token_ids[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE]
        elif tag == "BlockRemoved":
            _, block_hashes, medium = event
            assert medium == "GPU" and set(block_hashes) <= hashes
            hashes.difference_update(block_hashes)
            num_removed += len(block_hashes)
        else:
            assert event == ["AllBlocksCleared"]
            hashes.clear()
    return num_removed


def test_events_replay_to_the_pool_cached_hashes(tiny_llama_dir, tmp_path) -> None:
    endpoint, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/kv-replay.sock"
    sub = Subscriber(endpoint, replay, "kv")  # before the engine: ipc reconnects
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
              enable_prefix_caching=True, num_gpu_blocks_override=12,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": endpoint,
                                "replay_endpoint": replay, "topic": "kv", "buffer_steps": 1000})
    core = llm.llm_engine.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    publisher = core.kv_event_publisher
    try:
        rng = random.Random(0)
        vocab = llm.llm_engine.config.model.vocab_size
        prefixes = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(3)]
        hashes: set[int] = set()
        stored: dict[int, list[int]] = {}
        applied = -1
        evicted = 0
        params = SamplingParams(max_tokens=3, temperature=0.0)

        def sync() -> None:
            nonlocal applied, evicted
            last = publisher.next_seq - 1
            # Only the first batches may be missed (before the subscription took): be brief.
            sub.receive_until(last, 20_000 if sub.live else 3_000)
            missing = [q for q in range(applied + 1, last + 1)
                       if q not in sub.live and q not in sub.replayed]
            if missing:  # joined late: replay fills the start, never a gap in the stream
                assert not sub.live or missing[-1] < min(sub.live), (missing, sorted(sub.live))
                sub.replayed.update(sub.request_replay(missing[0]))
            for seq in range(applied + 1, last + 1):
                evicted += apply(hashes, stored, sub.batch(seq))
            applied = last
            assert hashes == {wire(h) for h in pool.cached_block_hash_to_block}

        for i in range(10):
            # Two shared blocks (prefix hits after the first) and a new third one each time:
            # 16 hashes for 12 blocks, so later prompts evict earlier ones.
            prompt = prefixes[i % 3] + [rng.randrange(3, vocab) for _ in range(16 + i % 2)]
            llm.generate([{"prompt_token_ids": prompt}], params)
            sync()
            expected: list[bytes] = []
            extend_block_hashes(get_hash_fn("sha256"), BLOCK_SIZE, prompt, expected)
            for k, h in enumerate(expected):  # the prompt's full blocks, just computed or hit
                assert wire(h) in hashes
                assert stored[wire(h)] == prompt[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE]
        assert evicted > 0, "the traffic was meant to evict"
        live_before_reset = dict(sub.live)
        assert llm.reset_prefix_cache()
        sync()
        assert hashes == set() == {wire(h) for h in pool.cached_block_hash_to_block}

        # The PUB stream: consecutive seqs from the first one received, nothing dropped.
        seqs = sorted(sub.live)
        assert seqs, "the PUB socket delivered nothing"
        assert seqs == list(range(seqs[0], seqs[-1] + 1)) and publisher.num_dropped == 0
        # The replay socket returns the buffered batches from a start seq, byte for byte.
        replayed = sub.request_replay(2)
        assert [s for s, _ in replayed] == list(range(2, publisher.next_seq))
        assert all(sub.batch(s) == p for s, p in replayed)
        assert len(live_before_reset) < len(sub.live)
        # vLLM's own decoding (msgspec structs, array-like tagged events) reads every batch.
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        kinds = set()
        for payload in sub.live.values():
            batch = decoder.decode(payload)
            assert batch.data_parallel_rank == 0
            kinds |= {type(e).__name__ for e in batch.events}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    finally:
        llm.llm_engine.shutdown()
        sub.close()
    assert not publisher._thread.is_alive()


@pytest.mark.parametrize("raw, key", [
    ('{"enable_kv_cache_events": true, "port": 5557}', "'port'"),
    ('{"enable_kv_cache_events": "yes"}', "'enable_kv_cache_events'"),
    ('{"publisher": "kafka"}', "'publisher'"),
    ('{"endpoint": "localhost:5557"}', "'endpoint'"),
    ('{"endpoint": "tcp://*"}', "'endpoint'"),
    ('{"replay_endpoint": 5558}', "'replay_endpoint'"),
    ('{"buffer_steps": 0}', "'buffer_steps'"),
    ('{"hwm": -1}', "'hwm'"),
    ('{"max_queue_size": true}', "'max_queue_size'"),
    ('{"topic": 3}', "'topic'"),
    ("[1]", "JSON object"),
    ("{nope", "not valid JSON"),
])
def test_bad_config_is_refused_naming_flag_and_key(raw: str, key: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_kv_events_config(raw)
    assert "--kv-events-config" in str(e.value) and key in str(e.value)


def test_config_defaults_and_prefix_caching_required(tiny_llama_dir) -> None:
    assert parse_kv_events_config('{"enable_kv_cache_events": true}') == KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq")
    off = parse_kv_events_config('{"endpoint": "tcp://*:6000"}')
    assert off is not None and off.publisher == "null" and not off.active
    args = EngineArgs(model=str(tiny_llama_dir), kv_events_config='{"enable_kv_cache_events": '
                      'true}')
    with pytest.raises(ValueError, match="--enable-prefix-caching"):
        args.create_engine_config()


def test_hashes_are_vllm_ints_by_default_and_digests_on_request() -> None:
    digest, parent = bytes(range(32)), bytes(range(32, 64))
    events = [PoolBlockStored([digest], parent, list(range(16)), 16), PoolBlockRemoved([digest])]
    assert read_env({}).kv_events_int_block_hashes
    assert not read_env({"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}).kv_events_int_block_hashes
    as_ints = msgpack.unpackb(encode_batch(1.0, events, 0), raw=False)[1]
    assert as_ints[0][1] == [wire(digest)] and as_ints[0][2] == wire(parent)
    assert as_ints[1][1] == [wire(digest)] == [external_block_hash(digest, True)]
    as_bytes = msgpack.unpackb(encode_batch(1.0, events, 0, int_hashes=False), raw=False)[1]
    assert as_bytes[0][1] == [digest] and as_bytes[0][2] == parent
    assert as_bytes[1][1] == [digest]


def test_endpoint_port_offset_by_data_parallel_rank() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://[::1]:5558", 1) == "tcp://[::1]:5559"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None
    with pytest.raises(ValueError, match="--kv-events-config"):
        offset_endpoint_port("ipc:///tmp/kv", 1)
