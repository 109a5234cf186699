"""The ``--kv-events-config`` JSON both vLLM and ``switchyard sim`` take (vLLM's ``KVEventsConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how an engine publishes its KV-cache events.

    Attributes:
        enable_kv_cache_events: Publish at all.
        publisher: ``"zmq"`` (the default when enabled) or ``"null"``.
        endpoint: The PUB socket (``tcp://*:5557`` binds every interface).
        replay_endpoint: The ROUTER socket answering replay requests (None: no replay).
        buffer_steps: Batches kept for replay.
        hwm: The PUB socket's high-water mark (messages queued per subscriber before dropping).
        max_queue_size: Batches queued for the publishing thread.
        topic: The first frame of every message.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        """Events go out on ZeroMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_FIELDS = set(KVEventsConfig.__dataclass_fields__)


def parse(text: str) -> KVEventsConfig:
    """The config in a ``--kv-events-config`` argument.

    Raises:
        ValueError: Not a JSON object, an unknown key, or a value of the wrong type.
    """
    try:
        raw: Any = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}")
    if raw.get("publisher") is None:
        raw["publisher"] = "zmq" if raw.get("enable_kv_cache_events") else "null"
    try:
        return msgspec.convert(raw, KVEventsConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None
