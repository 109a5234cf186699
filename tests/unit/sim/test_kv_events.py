"""The simulator's KV-cache events: what the engine core records per step, and what an engine publishes."""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from litestar.testing import AsyncTestClient

from switchyard.kvcache.config import KVEventsConfig
from switchyard.kvcache.wire import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, Event, decode, seq_of
from switchyard.sim import EngineConfig, create_engine_app
from switchyard.sim.config import resolve, with_kv_events
from switchyard.sim.core import EngineCore
from switchyard.sim.kv import HASH_MASK, external_hash

from .conftest import CoreFactory, make_request, prompt_of, run_until_done

BS = 16


class Recorder:
    """The core's event sink: one list per step that recorded any."""

    def __init__(self) -> None:
        self.batches: list[list[Event]] = []

    def __call__(self, events: list[Event]) -> None:
        self.batches.append(events)

    def take(self) -> list[list[Event]]:
        out, self.batches = self.batches, []
        return out


def with_events(core: EngineCore) -> Recorder:
    recorder = Recorder()
    core.enable_kv_events(recorder)
    return recorder


def serve(core: EngineCore, prompt: list[int], max_output: int = 1) -> None:
    req = make_request(prompt, max_output=max_output, arrival=core.now)
    core.add_request(req)
    run_until_done(core, [req])


def stored_hashes(core: EngineCore, prompt: list[int]) -> list[int | bytes]:
    req = make_request(prompt)
    return [external_hash(h) for h in req.full_block_hashes(len(prompt) // BS, BS)]


def test_a_prompt_stores_its_full_blocks_in_one_event_chained_from_none(make_core: CoreFactory) -> None:
    core = make_core()
    events = with_events(core)
    prompt = prompt_of(40)
    serve(core, prompt)
    assert events.take() == [[BlockStored(
        block_hashes=stored_hashes(core, prompt), parent_block_hash=None, token_ids=prompt[:32], block_size=BS,
        lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0)]]
    assert all(isinstance(h, int) and 0 <= h <= HASH_MASK for h in stored_hashes(core, prompt))


def test_a_decode_that_fills_a_block_stores_it_with_its_parent(make_core: CoreFactory) -> None:
    core = make_core()
    events = with_events(core)
    prompt = prompt_of(20)
    req = make_request(prompt, max_output=20, arrival=0.0)
    core.add_request(req)
    run_until_done(core, [req])
    batches = events.take()
    assert len(batches) == 2 and all(len(b) == 1 for b in batches)
    first, second = (b[0] for b in batches)
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert second.parent_block_hash == first.block_hashes[-1]
    assert len(second.block_hashes) == 1
    assert second.token_ids == (prompt + req.output)[16:32]  # generated tokens are in it
    # It was stored in the step that computed the block's last token.
    assert req.output and len(prompt) + len(req.output) > 32


def test_a_repeated_prompt_stores_nothing_new_but_a_recomputed_last_block(make_core: CoreFactory) -> None:
    core = make_core()
    events = with_events(core)
    prompt = prompt_of(40)
    serve(core, prompt)
    events.take()
    serve(core, prompt)
    assert events.take() == []
    # A prompt of whole blocks recomputes its last block (its last token needs logits), and vLLM
    # stores that copy again, chained to the block before it.
    whole = prompt_of(48, offset=3)
    serve(core, whole)
    events.take()
    serve(core, whole)
    hashes = stored_hashes(core, whole)
    [[again]] = events.take()
    assert isinstance(again, BlockStored)
    assert again.block_hashes == hashes[2:] and again.parent_block_hash == hashes[1]


def test_eviction_removes_each_cached_block_once(make_core: CoreFactory) -> None:
    core = make_core(kv_cache_tokens=6 * BS, max_model_len=6 * BS)
    events = with_events(core)
    a, b = prompt_of(64, offset=1), prompt_of(64, offset=2)
    serve(core, a)
    serve(core, b)  # 4 + 4 blocks in a 6-block pool: two of a's are evicted, tail... head of the LRU
    batches = events.take()
    removed = [h for batch in batches for e in batch if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert len(removed) == 2 and set(removed) <= set(stored_hashes(core, a))
    removals = [e for batch in batches for e in batch if isinstance(e, BlockRemoved)]
    assert all(len(e.block_hashes) == 1 and e.medium == "GPU" and e.group_idx == 0 for e in removals)
    # Evictions come before the stores of the step that caused them.
    kinds = [type(e).__name__ for e in batches[-1]]
    assert kinds == ["BlockRemoved", "BlockRemoved", "BlockStored"]


def test_reset_clears_only_when_idle_and_the_clear_goes_out_with_the_next_step(make_core: CoreFactory) -> None:
    core = make_core()
    events = with_events(core)
    busy = make_request(prompt_of(40), max_output=50)
    core.add_request(busy)
    core.step()
    assert not core.reset_prefix_cache()  # blocks in use: refused, as vLLM refuses
    run_until_done(core, [busy])
    events.take()
    assert core.reset_prefix_cache()
    assert core.kv.num_cached == 0
    assert events.take() == []  # queued, not yet published
    serve(core, prompt_of(40))
    [batch] = events.take()
    assert isinstance(batch[0], AllBlocksCleared) and isinstance(batch[1], BlockStored)
    assert batch[1].parent_block_hash is None


def test_reset_running_requests_preempts_them(make_core: CoreFactory) -> None:
    core = make_core()
    busy = make_request(prompt_of(40), max_output=50)
    core.add_request(busy)
    core.step()
    assert core.reset_prefix_cache(reset_running_requests=True)
    assert not core.running and busy.num_preemptions == 1
    run_until_done(core, [busy])


def _busy(make_core: CoreFactory, use_advance: bool) -> tuple[EngineCore, list[list[Event]]]:
    core = make_core(kv_cache_tokens=16 * 300, max_model_len=2048, max_num_seqs=24,
                     max_num_batched_tokens=1024, frontend_overhead_s=0.004)
    events = with_events(core)
    shared = prompt_of(200, 9)
    reqs = [make_request((shared if i % 3 == 0 else []) + prompt_of(30 + (i * 37) % 400, i),
                         max_output=5 + (i * 53) % 300, priority=i % 4, arrival=0.002 * i, seed=i)
            for i in range(60)]
    pending = list(reqs)
    while pending or core.has_work():
        while pending and (pending[0].arrival <= core.now or not core.has_work()):
            core.add_request(pending.pop(0))
        if use_advance:
            core.advance(until=pending[0].arrival if pending else float("inf"))
        else:
            core.step()
    return core, events.take()


def test_decode_runs_publish_the_same_batches_as_single_steps(make_core: CoreFactory) -> None:
    stepped_core, stepped = _busy(make_core, use_advance=False)
    _, advanced = _busy(make_core, use_advance=True)
    assert stepped_core.stats.preemptions > 0 and stepped_core.kv.evictions > 0
    assert advanced == stepped
    assert len(stepped) < stepped_core.steps  # steps that changed nothing publish nothing


def test_the_events_replayed_give_the_pools_cache(make_core: CoreFactory) -> None:
    core, batches = _busy(make_core, use_advance=True)
    held: Counter[int | bytes] = Counter()
    for batch in batches:
        for e in batch:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size == len(e.block_hashes) * BS
                held.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    assert held[h] > 0, "removed a block that was never stored"
                    held[h] -= 1
            else:
                held.clear()
    expected: Counter[int | bytes] = Counter(external_hash(h) for h in core.kv._hash if h is not None)
    assert +held == expected


# --- an engine publishing on ZeroMQ -------------------------------------------------------------------------


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sy-kv-") as d:
        yield Path(d)


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        frames: list[list[bytes]] = []
        while not frames or frames[-1][2] != END_SEQ:
            frames.append(dealer.recv_multipart())
        return frames
    finally:
        dealer.close()


async def _replay_until(endpoint: str, count: int) -> list[list[bytes]]:
    import asyncio

    for _ in range(100):
        frames = await asyncio.to_thread(_replay, endpoint, 0)
        if len(frames) - 1 >= count:
            return frames
        await asyncio.sleep(0.02)
    raise AssertionError(f"fewer than {count} batches were published")


async def test_an_engine_publishes_its_steps_and_replays_them(ipc_dir: Path) -> None:
    kv = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{ipc_dir}/ev",
                        replay_endpoint=f"ipc://{ipc_dir}/replay", topic="sim")
    app = create_engine_app(EngineConfig(served_model="m", port=1, time_scale=1000, seed=1, kv_events=kv))
    prompt = list(range(1000, 1040))
    async with AsyncTestClient(app=app) as client:
        state: dict[str, Any] = (await client.get("/sim/state")).json()
        assert state["kv_events"]["endpoint"] == kv.endpoint
        body = {"model": "m", "prompt": prompt, "max_tokens": 1}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert (await client.post("/reset_prefix_cache")).json() == {"success": True}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        frames = await _replay_until(f"ipc://{ipc_dir}/replay", 2)
        assert [seq_of(f[2]) for f in frames[:-1]] == [0, 1]
        assert all(f[1] == b"sim" for f in frames[:-1])
        first, second = (decode(f[3]) for f in frames[:-1])
        assert first.data_parallel_rank == 0
        assert [type(e) for e in first.events] == [BlockStored]
        assert [type(e) for e in second.events] == [AllBlocksCleared, BlockStored]
        assert first.events[0].token_ids == prompt[:32]  # type: ignore[union-attr]
        assert frames[-1] == [b"", b"", END_SEQ, b""]
    assert app.state["engine"].kv_publisher is None  # closed on shutdown


def test_engines_of_one_process_get_offset_endpoints() -> None:
    configs = [EngineConfig(served_model="m", port=p) for p in (8001, 8002, 8003)]
    out = with_kv_events(configs, '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                                  '"replay_endpoint": "tcp://127.0.0.1:5600"}')
    assert [(c.kv_events.endpoint, c.kv_events.replay_endpoint) for c in out if c.kv_events] == [
        ("tcp://*:5557", "tcp://127.0.0.1:5600"), ("tcp://*:5558", "tcp://127.0.0.1:5601"),
        ("tcp://*:5559", "tcp://127.0.0.1:5602")]
    assert "kv events tcp://*:5558, replay tcp://127.0.0.1:5601" in resolve(out[1]).describe()
    with pytest.raises(ValueError, match="unknown key"):
        with_kv_events(configs, '{"enable_kv_cache_events": true, "bogus": 1}')
    with pytest.raises(ValueError, match="publisher"):
        resolve(EngineConfig(served_model="m", port=1, kv_events=KVEventsConfig(
            enable_kv_cache_events=True, publisher="kafka")))
