"""vLLM's KV-cache events on the wire, matching ``vllm/distributed/kv_events.py`` (vLLM 0.32) exactly.

An engine started with ``--kv-events-config`` publishes on a ZeroMQ PUB socket, one multipart message
per engine step that changed its prefix cache: ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
counter from 0 (one per batch, per publisher process), ``payload`` a msgpack :class:`KVEventBatch`:
an array ``[ts, events, data_parallel_rank]`` (the rank omitted when unset) whose events are maps tagged
with ``"type"``: :class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared`.

The replay socket is a ROUTER: a client (DEALER or REQ) sends one frame, the first sequence number it
wants as 8 bytes big-endian; the publisher answers ``[b"", topic, seq, payload]`` for every buffered batch
from there on, then the end marker ``[b"", b"", END_SEQ, b""]`` (``END_SEQ`` is -1 as 8 signed bytes).

Block hashes are what vLLM's ``ExternalBlockHash`` is: by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)
the low 64 bits of the block's sha256 as an unsigned int, else the raw bytes. A block's parent is the block
before it in the same sequence (None for a sequence's first block). Consumers must not recompute them:
they name blocks only within one engine's stream.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: What a block hash is on the wire (vLLM's ``ExternalBlockHash``).
BlockHash = bytes | int

#: The replay socket's end-of-replay sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events (vLLM's ``EventBatch``)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV-cache events (vLLM's ``KVCacheEvent``)."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: ``block_hashes`` in order, the first one's parent
    ``parent_block_hash``, their ``token_ids`` (``block_size`` per block) back to back."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted for room)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset (``/reset_prefix_cache``)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """An :class:`EventBatch` of KV-cache events (vLLM's ``KVEventBatch``)."""

    events: list[Event]


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode(payload: bytes) -> KVEventBatch:
    """The batch in a message's payload.

    Raises:
        msgspec.DecodeError: Not a KV event batch (also: an event type this version does not know).
    """
    return _decoder.decode(payload)


def encode(batch: KVEventBatch) -> bytes:
    """The payload of ``batch`` as vLLM's publisher writes it."""
    return _encoder.encode(batch)


def seq_bytes(seq: int) -> bytes:
    """A sequence number's frame (8 bytes big-endian)."""
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """The sequence number in a frame (signed: the replay's end marker is -1)."""
    return int.from_bytes(frame, "big", signed=True)
