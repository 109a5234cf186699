"""KV-cache events: the simulator publishes what vLLM 0.32 publishes, decoded by the one decoder.

Both engines run with ``--kv-events-config`` (PUB bound on an ipc path, replay on loopback; see the
fixtures). One scenario of token-id prompts, sized in each engine's own block size, runs against
the target (and against the simulator when the target is vLLM); each request's events are read
back through the replay socket and reduced to structure: event kinds per batch, blocks per
``BlockStored``, parents named by the prompt block they are, token ids against the prompt. Hash
values, the block size itself and everything else listed in ``EXCEPTIONS`` are not compared.
Eviction (``BlockRemoved``) is not reached here: vLLM's 1 GiB CPU cache holds far more than the
scenario (the unit tests cover it on the simulator).
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from switchyard.kvcache.wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode, seq_of
from tests.conformance.conftest import Target
from tests.conformance.test_conformance import EXCEPTIONS

#: The deliberate differences this test relies on.
RELIES_ON = ("block_size", "kv_hashes", "kv_reset", "kv_step_order")
TIMEOUT_MS = 5000


def block_size(target: Target) -> int:
    text = httpx.get(f"{target.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name in ("vllm:cache_config", "vllm:cache_config_info"):
            return int(family.samples[0].labels["block_size"])
    raise AssertionError("no vllm:cache_config_info")


def replay(endpoint: str, start: int) -> list[tuple[int, bytes, bytes]]:
    """(seq, topic, payload) of every buffered batch from ``start`` on, as the replay socket answers."""
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out: list[tuple[int, bytes, bytes]] = []
        while True:
            frames = dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b"", f"unexpected replay frames {frames!r}"
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                return out
            out.append((seq_of(frames[2]), frames[1], frames[3]))
    finally:
        dealer.close()


@dataclass
class Reader:
    """Reads one engine's batches as a test makes requests, and names its blocks by prompt position."""

    target: Target
    bs: int
    next_seq: int = 0
    names: dict[Any, str] = field(default_factory=dict)
    live: zmq.Socket[bytes] | None = None

    def start(self) -> None:
        assert self.target.kv_endpoint and self.target.kv_replay
        seen = replay(self.target.kv_replay, 0)
        # Sequence numbers start at 0 and have no gaps (the buffer holds the whole session).
        assert [s for s, _, _ in seen] == list(range(len(seen)))
        self.next_seq = len(seen)
        self.live = zmq.Context.instance().socket(zmq.SUB)
        self.live.setsockopt(zmq.SUBSCRIBE, b"")
        self.live.setsockopt(zmq.LINGER, 0)
        self.live.connect(self.target.kv_endpoint)
        time.sleep(0.3)  # a SUB socket misses what is published before it has joined

    def request(self, prompt: list[int], label: str, settle: float = 0.3) -> list[list[tuple[Any, ...]]]:
        """Send ``prompt`` (one output token); the structure of the batches it caused."""
        body = {"model": self.target.model, "prompt": prompt, "max_tokens": 1}
        answer = httpx.post(f"{self.target.api}/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return self.collect(prompt, label, settle)

    def collect(self, prompt: list[int], label: str, settle: float = 0.3) -> list[list[tuple[Any, ...]]]:
        assert self.target.kv_replay is not None
        time.sleep(settle)  # the batch is queued before the answer leaves; the publisher sends it soon after
        batches = replay(self.target.kv_replay, self.next_seq)
        assert [s for s, _, _ in batches] == list(range(self.next_seq, self.next_seq + len(batches)))
        self.next_seq += len(batches)
        return [self.describe(decode(payload), prompt, label) for _, _, payload in batches]

    def describe(self, batch: KVEventBatch, prompt: list[int], label: str) -> list[tuple[Any, ...]]:
        bs = self.bs
        assert isinstance(batch.ts, float) and batch.data_parallel_rank == 0
        out: list[tuple[Any, ...]] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == bs and event.medium == "GPU" and event.group_idx == 0
                assert event.lora_id is None and event.lora_name is None
                # EXCEPTIONS["kv_hashes"]: values differ, the type does not.
                assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in event.block_hashes)
                assert len(event.token_ids) == len(event.block_hashes) * bs
                parent = "none" if event.parent_block_hash is None else self.names.get(event.parent_block_hash, "?")
                # Which blocks of the prompt these are: found by their tokens.
                first = next((i for i in range(0, len(prompt) - len(event.token_ids) + 1, bs)
                              if prompt[i:i + len(event.token_ids)] == event.token_ids), None)
                assert first is not None, "stored tokens that are not whole blocks of the prompt"
                for n, h in enumerate(event.block_hashes):
                    self.names[h] = f"{label}#{first // bs + n}"
                out.append(("stored", len(event.block_hashes), f"{label}#{first // bs}", parent))
            elif isinstance(event, BlockRemoved):
                out.append(("removed", len(event.block_hashes)))
            else:
                assert isinstance(event, AllBlocksCleared)
                self.names.clear()
                out.append(("cleared",))
        return out

    def live_batches(self) -> list[tuple[int, bytes]]:
        assert self.live is not None
        self.live.setsockopt(zmq.RCVTIMEO, 300)
        out = []
        try:
            while True:
                topic, seq, payload = self.live.recv_multipart()
                assert topic == b""
                out.append((seq_of(seq), payload))
        except zmq.Again:
            return out
        finally:
            self.live.close()


def scenario(target: Target) -> list[Any]:
    """The scenario's observations on one engine (prompts sized in its block size ``B``)."""
    bs = block_size(target)
    rng = random.Random(uuid.uuid4().int)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 1500) for _ in range(n)]

    reader = Reader(target, bs)
    reader.start()
    first_seq = reader.next_seq
    seen: list[Any] = []
    one = fresh(2 * bs + bs // 2)  # two full blocks and a partial one
    seen.append(("new prompt", reader.request(one, "one")))
    seen.append(("repeat", reader.request(one, "one")))
    two = one[:2 * bs] + fresh(bs + bs // 2)  # shares two blocks with the first
    seen.append(("shared prefix", reader.request(two, "two")))
    whole = fresh(2 * bs)  # whole blocks: a repeat recomputes the last one
    seen.append(("whole blocks", reader.request(whole, "whole")))
    seen.append(("whole blocks again", reader.request(whole, "whole")))
    reset = httpx.post(f"{target.url}/reset_prefix_cache", timeout=30)  # EXCEPTIONS["kv_reset"]
    assert reset.status_code == 200 and reset.json() == {"success": True}
    seen.append(("reset", reader.collect([], "none")))  # the clear waits for the next step
    seen.append(("after the reset", reader.request(one, "one")))
    # The live stream carried the same batches, byte for byte, as the replay.
    assert target.kv_replay is not None
    replayed = [(s, p) for s, _, p in replay(target.kv_replay, first_seq)]
    assert reader.live_batches() == replayed
    return seen


EXPECTED = [
    ("new prompt", [[("stored", 2, "one#0", "none")]]),
    ("repeat", []),  # nothing new: no batch at all
    ("shared prefix", [[("stored", 1, "two#2", "one#1")]]),
    ("whole blocks", [[("stored", 2, "whole#0", "none")]]),
    # Its last token needs logits, so its last block is computed again and stored again.
    ("whole blocks again", [[("stored", 1, "whole#1", "whole#0")]]),
    ("reset", []),
    ("after the reset", [[("cleared",), ("stored", 2, "one#0", "none")]]),
]


def test_kv_cache_events(target: Target, sim: Target) -> None:
    assert set(RELIES_ON) <= set(EXCEPTIONS)
    seen = scenario(target)
    assert seen == EXPECTED
    if target.is_vllm:
        assert scenario(sim) == seen


def test_replay_from_a_sequence_number_and_its_end_marker(target: Target) -> None:
    assert target.kv_replay is not None
    httpx.post(f"{target.api}/completions", json={"model": target.model, "prompt": [7] * 300, "max_tokens": 1},
               timeout=60).raise_for_status()
    time.sleep(0.3)
    everything = replay(target.kv_replay, 0)
    assert everything and [s for s, _, _ in everything] == list(range(len(everything)))
    last = everything[-1][0]
    assert replay(target.kv_replay, last) == everything[-1:]
    assert replay(target.kv_replay, last + 1) == []  # only the end marker
    assert all(topic == b"" for _, topic, _ in everything)
