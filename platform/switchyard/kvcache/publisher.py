"""A KV-cache event publisher that behaves as vLLM 0.32's ``ZmqEventPublisher`` on the wire.

The engine hands each step's events to :meth:`Publisher.publish`, which only puts them on a bounded queue
(never blocking: when the queue is full the batch is dropped and counted) and wakes the publisher's thread
through a socket pair; the thread sleeps until a batch, a replay request or :meth:`Publisher.close` wakes
it (an idle engine's publisher costs nothing: it used to look at its queue twenty times a second). The
thread numbers the batches (from 0, one per batch), encodes them, sends ``[topic, seq, payload]`` on the PUB
socket, keeps the last ``buffer_steps`` of them, and answers replay requests on the ROUTER socket: for a
request frame holding a start sequence number it sends ``[client, b"", topic, seq, payload]`` for every
buffered batch from there on, then the end marker ``[client, b"", b"", END_SEQ, b""]``.

Endpoints follow vLLM's rule, which decides whether the PUB socket binds or connects: an endpoint with ``*``
or ``::`` in it, or an ``ipc://`` or ``inproc://`` one, is bound; any other (``tcp://127.0.0.1:5557``) is
*connected to*, so the subscriber must bind there. The replay socket is always bound. For a machine-local
publisher that subscribers connect to, use ``ipc://PATH``; ``tcp://*:PORT`` binds every interface.

Several engines of one process publish on offset endpoints, as vLLM's data-parallel ranks do
(:func:`offset_endpoint`): a TCP port plus the engine's index, an ``inproc``/``ipc`` name with ``_dpN``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from switchyard.kvcache.config import KVEventsConfig
from switchyard.kvcache.wire import END_SEQ, Event, KVEventBatch, encode, seq_bytes

log = logging.getLogger("switchyard.kvcache")

#: Seconds :meth:`Publisher.close` waits for queued batches to go out.
SHUTDOWN_TIMEOUT_S = 1.0


def is_bind_endpoint(endpoint: str) -> bool:
    """Whether vLLM binds ``endpoint`` (wildcard, IPv6 ``::``, ipc, inproc) rather than connecting to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str | None, index: int) -> str | None:
    """The endpoint of the ``index``-th publisher of a process (vLLM's per-data-parallel-rank offset).

    Index 0 and a TCP port of 0 are left as they are; a TCP port is raised by ``index``; an
    ``inproc://`` or ``ipc://`` name gets ``_dp<index>`` appended.

    Raises:
        ValueError: An endpoint of another transport, or a TCP endpoint without a numeric port.
    """
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{index}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"KV events endpoint {endpoint!r} has no port to offset")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"
    raise ValueError(f"KV events endpoint {endpoint!r}: only tcp://, ipc:// and inproc:// are supported")


def config_for(config: KVEventsConfig, index: int) -> KVEventsConfig:
    """``config`` with both endpoints offset for the ``index``-th engine of a process."""
    return dataclasses.replace(config, endpoint=offset_endpoint(config.endpoint, index) or config.endpoint,
                               replay_endpoint=offset_endpoint(config.replay_endpoint, index))


class Publisher:
    """Publishes KV event batches on ZeroMQ from a thread of its own.

    Sockets are set up (bound or connected) at construction, so a bad or busy address raises here.

    Args:
        config: Endpoints, buffer and queue sizes, topic (``config.publishing`` need not be checked
            by the caller: the config is used as given).
        data_parallel_rank: Written into every batch, as vLLM does (0 for a single engine).
        context: The ZeroMQ context (the process's shared instance by default).

    Raises:
        ValueError: The endpoints cannot be bound or connected (the message names them).
    """

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.topic = config.topic.encode()
        #: Batches dropped because the queue was full (vLLM would have blocked the engine instead).
        self.dropped = 0
        #: Batches sent.
        self.sent = 0
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize=max(1, config.max_queue_size))
        self._stop = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(0, config.buffer_steps))
        self._closed = False
        #: Written to (one byte) by :meth:`publish` and :meth:`close`; the thread polls it beside the replay socket.
        #: (Socket objects, not raw descriptors: once closed, a late write fails instead of reaching a reused one.)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        ctx = context if context is not None else zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self.endpoint = self._attach(self._pub, config.endpoint, bind=is_bind_endpoint(config.endpoint))
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._attach(self._replay, config.replay_endpoint, bind=True)
        except (zmq.ZMQError, ValueError) as exc:
            self._close_sockets()
            raise ValueError(f"KV events: cannot set up {config.endpoint}"
                             f"{f' / replay {config.replay_endpoint}' if config.replay_endpoint else ''}: "
                             f"{exc}") from None
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()

    @staticmethod
    def _attach(sock: zmq.Socket[bytes], endpoint: str, *, bind: bool) -> str:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        # A port of 0 (or ``*``) is chosen by the OS: report the one actually bound.
        bound = sock.getsockopt(zmq.LAST_ENDPOINT)
        return bound.decode() if isinstance(bound, bytes) else endpoint

    def publish(self, events: Sequence[Event]) -> bool:
        """Queue one step's events as a batch stamped now; never blocks.

        Returns:
            False if the batch was dropped (queue full) or the publisher is closed.
        """
        if self._closed or not events:
            return False
        batch = KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV events: the publishing queue of %s is full; dropping batches", self.endpoint)
            return False
        self._wake()
        return True

    def _wake(self) -> None:
        # A full buffer means the thread has wakes enough to read (it empties the queue each time it wakes); a
        # closed one, that the publisher is closed.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def close(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Send what is queued (for up to ``timeout`` seconds), stop the thread, close the sockets (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()  # the thread sends what is queued, then stops
        self._wake()
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            log.warning("KV events: the publisher thread of %s did not stop in %.1fs", self.endpoint, timeout)
            return  # the thread still uses the sockets; the process is going away anyway
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._wake_r.close()
        self._wake_w.close()

    # --- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        seq = 0
        replay = self._replay
        wake = self._wake_r.fileno()  # (a poller answers with the descriptor registered, not with its object)
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if replay is not None and replay in ready:
                try:
                    while replay.poll(0):
                        self._answer_replay(replay)
                except zmq.ZMQError as exc:
                    log.warning("KV events: replay request failed: %s", exc)
            if wake in ready:
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(65536)
            while True:
                try:
                    batch = self._queue.get_nowait()
                except queue.Empty:
                    break
                payload = encode(batch)
                try:
                    self._pub.send_multipart((self.topic, seq_bytes(seq), payload))
                except zmq.ZMQError as exc:
                    log.warning("KV events: sending batch %d failed: %s", seq, exc)
                    time.sleep(0.1)
                self._buffer.append((seq, payload))
                self.sent += 1
                seq += 1
            if self._stop.is_set():
                return

    def _answer_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: ignoring a replay request of %d frames", len(frames))
            return
        client, _, start_frame = frames
        start = int.from_bytes(start_frame, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))


def open_publisher(config: KVEventsConfig | None, *, data_parallel_rank: int = 0) -> Publisher | None:
    """A publisher for ``config``, or None when it does not publish (disabled, or the ``null`` publisher).

    Raises:
        ValueError: An unknown publisher kind, or endpoints that cannot be set up.
    """
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return None
    if config.publisher != "zmq":
        raise ValueError(f"KV events: unknown publisher {config.publisher!r} (zmq or null)")
    return Publisher(config, data_parallel_rank=data_parallel_rank)


__all__ = ["Publisher", "config_for", "is_bind_endpoint", "offset_endpoint", "open_publisher"]
