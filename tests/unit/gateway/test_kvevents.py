"""The gateway's subscriptions to KV-cache events, over real ZeroMQ sockets on loopback: syncing from the
replay socket, live batches, gaps filled, a restarted engine read again, two subscribers agreeing."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import pytest
import zmq

from switchyard.gateway.kvevents import Source, Subscriptions
from switchyard.kvcache import wire
from switchyard.kvcache.blocks import chain_keys
from switchyard.kvcache.config import KVEventsConfig
from switchyard.kvcache.publisher import Publisher
from switchyard.state.kvindex import EngineCaches

BS = 4
TOKENS = list(range(500, 540))  # 10 full blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stored(first: int, count: int, parent: int | None) -> wire.BlockStored:
    """Blocks ``first`` .. ``first + count - 1`` of TOKENS (hash = 1000 + index)."""
    return wire.BlockStored(block_hashes=[1000 + i for i in range(first, first + count)], parent_block_hash=parent,
                            token_ids=TOKENS[first * BS:(first + count) * BS], block_size=BS, lora_id=None,
                            medium="GPU", lora_name=None)


async def until(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def following(*sources: Source) -> AsyncIterator[EngineCaches]:
    caches = EngineCaches()
    subs = Subscriptions(caches)
    subs.update(sources)
    try:
        yield caches
    finally:
        await subs.close()


class RawEngine:
    """An engine's two sockets driven by hand, so that a test can skip or restart sequence numbers."""

    def __init__(self, events: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(events)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(replay)
        self.buffer: list[tuple[int, bytes]] = []

    def send(self, seq: int, *events: wire.Event, live: bool = True) -> None:
        payload = wire.encode(wire.KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0))
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart([b"", wire.seq_bytes(seq), payload])

    def answer_replays(self) -> None:
        while self.router.poll(0):
            client, _empty, start = self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    self.router.send_multipart([client, b"", b"", wire.seq_bytes(seq), payload])
            self.router.send_multipart([client, b"", b"", wire.END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def source(events_port: int, replay_port: int | None, url: str = "http://e1") -> Source:
    replay = f"tcp://127.0.0.1:{replay_port}" if replay_port else None
    return Source(url, f"tcp://127.0.0.1:{events_port}", replay, "", 30.0)


async def test_a_subscriber_reads_the_history_from_the_replay_then_follows_live_batches() -> None:
    port, replay = free_port(), free_port()
    publisher = Publisher(KVEventsConfig(True, "zmq", f"tcp://*:{port}", f"tcp://127.0.0.1:{replay}"))
    try:
        publisher.publish([stored(0, 2, None)])  # before anyone subscribed: only the replay has it
        publisher.publish([stored(2, 1, 1001)])
        await asyncio.sleep(0.1)
        async with following(source(port, replay)) as caches:
            cache = caches.get("http://e1")
            assert cache is not None
            await until(lambda: cache.synced and cache.last_seq == 1)
            assert caches.held("http://e1", TOKENS, 0.0) == 3 * BS
            publisher.publish([stored(3, 2, 1002)])
            await until(lambda: cache.last_seq == 2)
            assert caches.held("http://e1", TOKENS, 0.0) == 5 * BS
            publisher.publish([wire.BlockRemoved(block_hashes=[1001], medium="GPU")])
            await until(lambda: cache.last_seq == 3)
            assert caches.held("http://e1", TOKENS, 0.0) == 1 * BS
            publisher.publish([wire.AllBlocksCleared()])
            await until(lambda: cache.last_seq == 4)
            assert caches.held("http://e1", TOKENS, 0.0) == 0
            assert cache.connected and cache.state(0.0) == "live" and cache.gaps == 0
    finally:
        publisher.close()


async def test_a_gap_is_filled_from_the_replay_and_a_restart_is_read_again_from_its_start() -> None:
    port, replay = free_port(), free_port()
    engine = RawEngine(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    serving = True

    async def answer() -> None:
        while serving:
            engine.answer_replays()
            await asyncio.sleep(0.005)

    answering = asyncio.create_task(answer())
    try:
        async with following(source(port, replay)) as caches:
            cache = caches.get("http://e1")
            assert cache is not None
            await until(lambda: cache.synced)
            await asyncio.sleep(0.2)  # the subscription reaches the publisher
            engine.send(0, stored(0, 1, None))
            await until(lambda: cache.last_seq == 0)
            engine.send(1, stored(1, 1, 1000), live=False)  # lost on the way: only the replay has it
            engine.send(2, stored(2, 1, 1001))
            await until(lambda: cache.last_seq == 2 and cache.synced)
            assert cache.gaps == 1 and cache.gaps_recovered == 1
            assert caches.held("http://e1", TOKENS, 0.0) == 3 * BS
            # The engine restarts: its sequence starts again, with an empty cache and new blocks.
            engine.buffer.clear()
            engine.send(0, stored(5, 1, None))
            await until(lambda: cache.restarts == 1 and cache.synced and cache.last_seq == 0)
            assert caches.held("http://e1", TOKENS, 0.0) == 0  # never what it held before
            assert cache.blocks.keys() == set(chain_keys(TOKENS[5 * BS:6 * BS], BS))
    finally:
        serving = False
        await answering
        engine.close()


async def test_two_gateways_fed_the_same_engine_hold_equal_indexes() -> None:
    port, replay = free_port(), free_port()
    publisher = Publisher(KVEventsConfig(True, "zmq", f"tcp://*:{port}", f"tcp://127.0.0.1:{replay}"))
    try:
        publisher.publish([stored(0, 3, None)])
        async with following(source(port, replay)) as first:
            await until(lambda: first.get("http://e1").synced)  # type: ignore[union-attr]
            publisher.publish([stored(3, 3, 1002)])
            async with following(source(port, replay)) as second:  # joins later: reads the history
                await until(lambda: second.get("http://e1").synced)  # type: ignore[union-attr]
                await asyncio.sleep(0.2)
                publisher.publish([wire.BlockRemoved(block_hashes=[1005], medium="GPU"), stored(6, 2, None)])
                await until(lambda: all(c.get("http://e1").last_seq == 2 for c in (first, second)))  # type: ignore[union-attr]
                a, b = first.get("http://e1"), second.get("http://e1")
                assert a is not None and b is not None
                assert a.blocks.keys() == b.blocks.keys() and len(a.blocks) == 7
    finally:
        publisher.close()


async def test_without_a_replay_socket_an_engine_is_synced_from_its_first_live_batch() -> None:
    port = free_port()
    publisher = Publisher(KVEventsConfig(True, "zmq", f"tcp://*:{port}"))
    try:
        async with following(source(port, None)) as caches:
            cache = caches.get("http://e1")
            assert cache is not None
            await asyncio.sleep(0.3)
            assert caches.held("http://e1", TOKENS, 0.0) is None  # nothing read yet: not known
            publisher.publish([stored(0, 2, None)])
            await until(lambda: cache.synced)
            assert caches.held("http://e1", TOKENS, 0.0) == 2 * BS
    finally:
        publisher.close()


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:8401", "http://[::1]:8401"])
def test_a_pool_names_its_engines_sockets_by_port_or_by_offset(endpoint: str) -> None:
    from switchyard.policy.fleet import KvEvents

    host = endpoint.split("//")[1].rsplit(":", 1)[0]
    assert KvEvents(port=5557, replay_port=5558).addresses(endpoint) == (f"tcp://{host}:5557", f"tcp://{host}:5558")
    assert KvEvents(port_offset=1000).addresses(endpoint) == (f"tcp://{host}:9401", None)
    sockets = {endpoint: {"events": "ipc:///tmp/e1", "replay": f"tcp://{host}:7000"}}
    assert KvEvents.model_validate({"sockets": sockets}).addresses(endpoint) == ("ipc:///tmp/e1",
                                                                                 f"tcp://{host}:7000")
    with pytest.raises(ValueError, match="give `port`, `port_offset` or `sockets`"):
        KvEvents()
    with pytest.raises(ValueError, match="must be tcp://HOST:PORT"):
        KvEvents.model_validate({"sockets": {endpoint: {"events": "tcp://*:5557"}}})
