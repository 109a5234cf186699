"""The KV event publisher against real ZeroMQ sockets on this machine (ipc and 127.0.0.1 only)."""

from __future__ import annotations

import queue
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from switchyard.kvcache.config import KVEventsConfig, parse
from switchyard.kvcache.publisher import Publisher, config_for, is_bind_endpoint, offset_endpoint, open_publisher
from switchyard.kvcache.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    decode,
    seq_of,
)
from tests.helpers import free_port

TIMEOUT_MS = 5000


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[1, 2] * len(hashes),
                       block_size=2, lora_id=None, medium="GPU", lora_name=None)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sy-kv-") as d:  # short: ipc paths are limited to ~100 bytes
        yield Path(d)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def subscribe(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, *, bind: bool = False,
              topic: bytes = b"") -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.setsockopt(zmq.LINGER, 0)
    if bind:
        sub.bind(endpoint)
    else:
        sub.connect(endpoint)
    return sub


def publish_until_seen(pub: Publisher, sub: zmq.Socket[bytes]) -> list[bytes]:
    """Publish probes until the subscription is live (ZeroMQ drops what a PUB sends before it joins)."""
    sub.setsockopt(zmq.RCVTIMEO, 50)
    try:
        for _ in range(100):
            pub.publish([AllBlocksCleared()])
            try:
                return sub.recv_multipart()
            except zmq.Again:
                continue
    finally:
        sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    raise AssertionError("the subscriber never received anything")


def replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[list[bytes]] = []
        while True:
            frames = dealer.recv_multipart()
            out.append(frames)
            if frames[2] == END_SEQ:
                return out
    finally:
        dealer.close()


def test_batches_go_out_numbered_from_zero_with_vllms_frames(ctx: zmq.Context[zmq.Socket[bytes]],
                                                             ipc_dir: Path) -> None:
    config = parse(f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{ipc_dir}/ev", "topic": "kv"}}')
    pub = Publisher(config, context=ctx)
    try:
        assert pub.endpoint == f"ipc://{ipc_dir}/ev"
        sub = subscribe(ctx, pub.endpoint, topic=b"kv")
        first = publish_until_seen(pub, sub)
        assert first[0] == b"kv" and len(first[1]) == 8
        base = seq_of(first[1])
        events: list[Event] = [stored(11, 12, parent=None), stored(13, parent=12),
                               BlockRemoved(block_hashes=[11], medium="GPU")]
        before = time.time()
        assert pub.publish(events)
        assert not pub.publish([])  # an empty step publishes nothing
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and seq_of(seq) == base + 1
        batch = decode(payload)
        assert batch.events == events
        assert batch.data_parallel_rank == 0
        assert before - 1 <= batch.ts <= time.time() + 1
        sub.close()
    finally:
        pub.close()
    assert pub.sent >= 2 and pub.dropped == 0


def test_the_first_batch_is_seq_zero_and_replay_returns_the_buffer_then_the_end_marker(
        ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint="tcp://127.0.0.1:0",
                            buffer_steps=3)
    # A tcp endpoint with a host is connected to, as vLLM does: the subscriber binds it.
    assert not is_bind_endpoint(config.endpoint)
    sub = subscribe(ctx, config.endpoint, bind=True)
    pub = Publisher(config, context=ctx)
    try:
        assert pub.replay_endpoint is not None and not pub.replay_endpoint.endswith(":0")
        for n in range(5):
            pub.publish([stored(100 + n)])
        # Replay is answered from the thread that publishes: wait until all five went out.
        deadline = time.monotonic() + 5
        while pub.sent < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        frames = replay(ctx, pub.replay_endpoint, 0)
        # Only the last buffer_steps batches are kept.
        assert [seq_of(f[2]) for f in frames[:-1]] == [2, 3, 4]
        for client_part, f in zip([b""] * 3, frames[:-1], strict=True):
            assert f[0] == client_part and f[1] == b""
            assert decode(f[3]).events == [stored(100 + seq_of(f[2]))]
        assert frames[-1] == [b"", b"", END_SEQ, b""]
        assert [seq_of(f[2]) for f in replay(ctx, pub.replay_endpoint, 4)[:-1]] == [4]
        assert replay(ctx, pub.replay_endpoint, 9) == [[b"", b"", END_SEQ, b""]]
        # The live stream: whatever arrived is numbered consecutively (the first ones may be lost to
        # the connection's start, which is what replay is for).
        seqs = []
        sub.setsockopt(zmq.RCVTIMEO, 200)
        while True:
            try:
                seqs.append(seq_of(sub.recv_multipart()[1]))
            except zmq.Again:
                break
        assert seqs == list(range(5 - len(seqs), 5))
    finally:
        pub.close()
        sub.close()


def test_a_full_queue_drops_instead_of_blocking(ipc_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{ipc_dir}/q",
                            max_queue_size=1)
    pub = Publisher(config, context=ctx)
    try:
        start = time.monotonic()
        results = [pub.publish([stored(n)]) for n in range(2000)]
        assert time.monotonic() - start < 2
        assert results[0]
        assert pub.dropped == results.count(False)
    finally:
        pub.close()
    assert not pub.publish([stored(1)])  # closed


def test_close_is_quick_and_idempotent(ipc_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = Publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{ipc_dir}/c",
                                   replay_endpoint=f"ipc://{ipc_dir}/r"), context=ctx)
    start = time.monotonic()
    pub.close()
    pub.close()
    assert time.monotonic() - start < 1
    # The addresses are free again.
    again = Publisher(pub.config, context=ctx)
    again.close()


def test_a_busy_address_is_one_clear_error(ctx: zmq.Context[zmq.Socket[bytes]], ipc_dir: Path) -> None:
    port = free_port()
    holder = ctx.socket(zmq.ROUTER)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(ValueError, match="cannot set up"):
            Publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{ipc_dir}/b",
                                     replay_endpoint=f"tcp://127.0.0.1:{port}"), context=ctx)
    finally:
        holder.close()


def test_endpoints_are_offset_per_engine_like_vllms_data_parallel_ranks() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://127.0.0.1:0", 2) == "tcp://127.0.0.1:0"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint(None, 2) is None
    with pytest.raises(ValueError, match="only tcp"):
        offset_endpoint("udp://x:1", 1)
    config = config_for(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557",
                                       replay_endpoint="tcp://*:5600"), 2)
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:5559", "tcp://*:5602")
    assert is_bind_endpoint("tcp://*:1") and is_bind_endpoint("ipc:///x") and is_bind_endpoint("tcp://[::1]:1")
    assert not is_bind_endpoint("tcp://127.0.0.1:1")


def test_open_publisher_only_for_zmq() -> None:
    assert open_publisher(None) is None
    assert open_publisher(parse('{"enable_kv_cache_events": false, "publisher": "zmq"}')) is None
    assert open_publisher(parse('{"enable_kv_cache_events": true, "publisher": "null"}')) is None
    with pytest.raises(ValueError, match="unknown publisher"):
        open_publisher(parse('{"enable_kv_cache_events": true, "publisher": "kafka"}'))


def test_an_idle_publisher_sleeps_until_a_batch_or_a_replay_request_wakes_it(
        ipc_dir: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = Publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{ipc_dir}/w",
                                   replay_endpoint=f"ipc://{ipc_dir}/wr"), context=ctx)
    looks: list[int] = []

    class Watched(queue.Queue[KVEventBatch]):
        def get_nowait(self) -> KVEventBatch:
            looks.append(1)
            return super().get_nowait()

    sub = subscribe(ctx, pub.endpoint)
    try:
        publish_until_seen(pub, sub)
        time.sleep(0.1)  # (the thread is back asleep)
        pub._queue = Watched()  # what the thread reads from now on
        time.sleep(0.5)
        assert looks == []  # half a second idle: the thread never looked at its queue
        assert pub.publish([stored(7)])
        assert decode(sub.recv_multipart()[2]).events == [stored(7)]  # a batch wakes it at once
        assert len(looks) >= 1
        answered = replay(ctx, pub.replay_endpoint or "", 0)  # and so does a replay request
        assert answered[-1][2] == END_SEQ and len(answered) >= 2
    finally:
        sub.close()
        pub.close()
    assert not pub._thread.is_alive()
