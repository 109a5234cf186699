"""The gateway's subscriptions to its engines' KV-cache events (off the request path).

Every gateway process subscribes to every endpoint whose pool declares ``kv_events`` (ZeroMQ SUB, pyzmq's
asyncio sockets) and keeps that engine's :class:`~switchyard.state.kvindex.EngineCache` in step with the
stream; no store is shared between replicas, each reads the engines themselves.

Keeping in step:

- On connecting (and on every reconnection: the engine may have restarted), the index is cleared and the
  engine's history is read from its replay socket from sequence 0 while live batches are held back; then
  the held live batches after the replayed ones are applied. Until then the endpoint is *syncing*, and the
  precise scorer does not route on it.
- A live batch whose sequence number skips ahead is a gap: the missing batches are asked from the replay
  socket (``gaps_recovered`` when they come); a gap the replay no longer holds clears the index.
- A sequence number that goes back means the engine restarted: the index is cleared and read again.
- Without a replay socket an engine is synced from its first live batch (what it held before is unknown,
  and blocks stored on top of it cannot be named: they are counted as orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from switchyard.gateway.metrics import GatewayMetrics
from switchyard.kvcache import wire
from switchyard.policy import PolicySnapshot
from switchyard.state.kvindex import EngineCache, EngineCaches

log = logging.getLogger("switchyard.kvevents")

#: Seconds to wait for the replay socket's answer before trying again.
REPLAY_TIMEOUT_S = 5.0
#: Seconds between tries to sync an engine whose replay did not answer.
RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Source:
    """Where one endpoint publishes: the PUB socket, the replay socket (None: none), the topic."""

    url: str
    events: str
    replay: str | None
    topic: str
    stale_after_s: float


def sources_of(snapshot: PolicySnapshot) -> list[Source]:
    """Every endpoint of a pool that declares ``kv_events``, with where it publishes."""
    out: list[Source] = []
    for pool in snapshot.document.pools:
        spec = pool.kv_events
        if spec is None:
            continue
        for url in pool.endpoints:
            events, replay = spec.addresses(url)
            out.append(Source(url, events, replay, spec.topic, spec.stale_after))
    return out


class Follower:
    """Follows one engine's stream into its :class:`EngineCache`."""

    def __init__(self, source: Source, cache: EngineCache, context: zmq.asyncio.Context) -> None:
        self.source = source
        self.cache = cache
        self._context = context
        self._held: list[tuple[int, bytes]] = []
        self._sync: asyncio.Task[None] | None = None
        #: Seconds spent decoding and applying batches (the events' CPU cost on the event loop).
        self.busy_s = 0.0

    async def run(self) -> None:
        """Subscribe and follow until cancelled."""
        source, cache = self.source, self.cache
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2_000)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(source.events)
        watching = asyncio.create_task(self._watch(monitor), name=f"switchyard-kv-monitor {source.url}")
        try:
            while True:
                frames = await sub.recv_multipart(copy=True)
                if len(frames) != 3:
                    continue
                self._live(wire.seq_of(frames[1]), frames[2])
        finally:
            watching.cancel()
            self._cancel_sync()
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            cache.connected = False

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.cache.connected = True
                self._resync(0, "reading the engine's history")
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.cache.connected = False
                self._cancel_sync()
                self._held.clear()
                self.cache.reset("events disconnected (the engine may have restarted)")

    def _live(self, seq: int, payload: bytes) -> None:
        cache = self.cache
        if self._sync is not None:  # held back until the replay is applied
            self._held.append((seq, payload))
            return
        last = cache.last_seq if cache.last_seq is not None else -1
        if cache.synced and seq == last + 1:
            self._apply(seq, payload)
            return
        if not cache.synced:
            start, reason = 0, "reading the engine's history"
        elif seq > last + 1:
            cache.gaps += 1
            log.warning("KV events of %s: batches %d to %d missed", self.source.url, last + 1, seq - 1)
            start, reason = last + 1, "filling a gap"
        else:
            cache.restarts += 1
            log.warning("KV events of %s: sequence went back from %d to %d (engine restarted); reading it again",
                        self.source.url, last, seq)
            cache.reset("engine restarted")
            start, reason = 0, "engine restarted"
        if self.source.replay is None:  # nothing to read what came before from: start here
            if start > 0:
                cache.reset("a gap, and no replay socket to fill it")
            cache.synced, cache.reason = True, ""
            self._apply(seq, payload)
        else:
            self._held.append((seq, payload))
            self._resync(start, reason)

    def _apply(self, seq: int, payload: bytes) -> None:
        started = time.perf_counter()
        try:
            batch = wire.decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("KV events of %s: batch %d not understood (%s); skipped", self.source.url, seq, exc)
            self.cache.last_seq = seq
            return
        self.cache.apply(seq, batch.events, time.monotonic())
        self.busy_s += time.perf_counter() - started

    def _resync(self, start: int, reason: str) -> None:
        if self.source.replay is None:
            return
        self._cancel_sync()
        if start == 0:
            self.cache.reset(reason)
        else:
            self.cache.synced, self.cache.reason = False, reason
        self._sync = asyncio.create_task(self._replay(start), name=f"switchyard-kv-replay {self.source.url}")

    def _cancel_sync(self) -> None:
        if self._sync is not None and not self._sync.done():
            self._sync.cancel()
        self._sync = None

    async def _replay(self, start: int) -> None:
        """Ask the replay socket for everything from ``start``, apply it and the held live batches."""
        assert self.source.replay is not None
        cache = self.cache
        while True:
            try:
                batches = await self._ask(self.source.replay, start)
                break
            except (TimeoutError, zmq.ZMQError) as exc:
                cache.reason = f"replay socket did not answer ({exc or 'timeout'}); retrying"
                await asyncio.sleep(RETRY_S)
        held, self._held = self._held, []
        merged = dict(batches)
        for seq, payload in held:
            merged.setdefault(seq, payload)
        ordered = sorted(s for s in merged if s >= start)
        if start > 0 and (not ordered or ordered[0] != start):
            log.warning("KV events of %s: the replay no longer holds batch %d; index cleared", self.source.url, start)
            cache.reset("a gap the replay no longer held")
        elif start > 0:
            cache.gaps_recovered += 1
        expected: int | None = None
        for seq in ordered:
            if expected is not None and seq != expected:
                # A hole between the replay's last batch and the first live one: ask again from there.
                self._held = [(s, merged[s]) for s in ordered if s >= seq]
                cache.synced, cache.last_seq = True, expected - 1
                self._sync = None
                self._resync(expected, "filling a gap")
                return
            self._apply(seq, merged[seq])
            expected = seq + 1
        cache.synced, cache.reason = True, ""
        self._sync = None

    async def _ask(self, endpoint: str, start: int) -> list[tuple[int, bytes]]:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        try:
            await dealer.send_multipart([b"", wire.seq_bytes(start)])
            out: list[tuple[int, bytes]] = []
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4:
                    continue
                _empty, _topic, seq_frame, payload = frames
                if seq_frame == wire.END_SEQ:
                    return out
                out.append((wire.seq_of(seq_frame), payload))
        finally:
            dealer.close(linger=0)


class Exported:
    """What was last copied into the metrics, so that counters move by what changed."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.busy_s = 0.0
        self.urls: set[str] = set()


def export_metrics(subscriptions: Subscriptions, metrics: GatewayMetrics, exported: Exported, now: float) -> None:
    """Copy every stream's state into ``metrics`` (series of endpoints no longer followed are removed)."""
    caches = subscriptions.caches
    urls = {cache.url for cache in caches}
    for gone in exported.urls - urls:
        for family in (metrics.kv_connected, metrics.kv_stale, metrics.kv_blocks, metrics.kv_last_seq,
                       metrics.kv_events, metrics.kv_gaps_recovered, metrics.kv_restarts):
            with contextlib.suppress(KeyError):
                family.remove(gone)
        for key in [k for k in exported.counts if k[0] == gone]:
            del exported.counts[key]
    exported.urls = urls
    for cache in caches:
        url = cache.url
        metrics.kv_connected.labels(url).set(1 if cache.connected else 0)
        metrics.kv_stale.labels(url).set(0 if cache.known(now) else 1)
        metrics.kv_blocks.labels(url).set(len(cache.blocks))
        metrics.kv_last_seq.labels(url).set(cache.last_seq if cache.last_seq is not None else -1)
        for name, family, value in (("events", metrics.kv_events, cache.events),
                                    ("gaps", metrics.kv_gaps_recovered, cache.gaps_recovered),
                                    ("restarts", metrics.kv_restarts, cache.restarts)):
            before = exported.counts.get((url, name), 0)
            if value > before:
                family.labels(url).inc(value - before)
            exported.counts[(url, name)] = value
    busy = subscriptions.busy_s
    if busy > exported.busy_s:
        metrics.kv_seconds.inc(busy - exported.busy_s)
    exported.busy_s = busy


class Subscriptions:
    """Every endpoint's follower, kept to the policy's endpoints (:meth:`update` on every reload)."""

    def __init__(self, caches: EngineCaches) -> None:
        self.caches = caches
        self._context = zmq.asyncio.Context()
        self._followers: dict[str, tuple[Source, Follower, asyncio.Task[None]]] = {}

    @property
    def busy_s(self) -> float:
        """Seconds spent decoding and applying batches, all endpoints together (gone ones included)."""
        return self._busy_gone + sum(f.busy_s for _, f, _ in self._followers.values())

    _busy_gone = 0.0

    def update(self, sources: Iterable[Source]) -> None:
        """Follow exactly ``sources`` (one per endpoint): new ones start, changed ones restart, gone ones stop."""
        wanted = {s.url: s for s in sources}
        for url in list(self._followers):
            if wanted.get(url) != self._followers[url][0]:
                self._stop(url)
        for url, source in wanted.items():
            if url not in self._followers:
                cache = EngineCache(url, source.events, stale_after_s=source.stale_after_s)
                self.caches.add(cache)
                follower = Follower(source, cache, self._context)
                task = asyncio.get_running_loop().create_task(follower.run(), name=f"switchyard-kv {url}")
                self._followers[url] = (source, follower, task)

    def _stop(self, url: str) -> None:
        _, follower, task = self._followers.pop(url)
        task.cancel()
        self._busy_gone += follower.busy_s
        self.caches.remove(url)

    async def close(self) -> None:
        """Stop following every engine."""
        tasks = [t for _, _, t in self._followers.values()]
        for url in list(self._followers):
            self._stop(url)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        # Closes what a cancelled replay may still hold open, then ends the context (term() alone would wait).
        self._context.destroy(linger=0)
