"""The garbage fault modes in process: 200 answers to generation requests that no client can use."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import msgspec
import pytest
from litestar.testing import AsyncTestClient

from switchyard.sim import EngineConfig, create_engine_app
from switchyard.sim import garbage as garbage_module
from switchyard.sim.faults import GARBAGE_MODES, MODES, FaultState

Client = AsyncTestClient  # type: ignore[type-arg]


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    app = create_engine_app(EngineConfig(served_model="m", port=1, time_scale=1000, seed=1))
    async with AsyncTestClient(app=app) as c:
        yield c


async def _post(client: Client, path: str, stream: bool) -> tuple[int, str, bytes]:
    body = ({"messages": [{"role": "user", "content": "hi"}]} if path.endswith("chat/completions")
            else {"prompt": "hi"})
    resp = await client.post(path, json={**body, "max_tokens": 8, "stream": stream})
    return resp.status_code, resp.headers["content-type"], resp.content


def _json_ok(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def test_the_garbage_modes_are_modes() -> None:
    assert GARBAGE_MODES.issubset(MODES)
    state = FaultState()
    state.update({"mode": "huge", "error_rate": 1.0})
    assert state.draw() is None  # like hang: no rate is drawn while answers are garbage


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_invalid_json(client: Client, path: str) -> None:
    await client.post("/sim/faults", json={"mode": "invalid_json"})
    status, ctype, body = await _post(client, path, stream=False)
    assert status == 200 and ctype.startswith("application/json") and not _json_ok(body)
    status, ctype, body = await _post(client, path, stream=True)
    assert status == 200 and ctype.startswith("text/event-stream")
    first, _, rest = body.partition(b"\n\n")
    assert first.startswith(b"data: ") and not _json_ok(first[6:]) and rest == b"data: [DONE]\n\n"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_truncate(client: Client, path: str) -> None:
    await client.post("/sim/faults", json={"mode": "truncate"})
    status, ctype, body = await _post(client, path, stream=False)
    assert status == 200 and ctype.startswith("application/json")
    assert body.startswith(b'{"id":') and not _json_ok(body)
    status, ctype, body = await _post(client, path, stream=True)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = body.split(b"\n\n")
    whole, partial = events[:-1], events[-1]
    assert len(whole) >= 3 and all(_json_ok(e.removeprefix(b"data: ")) for e in whole)
    assert partial.startswith(b"data: {") and not _json_ok(partial[6:])  # it ends inside an event
    assert b"[DONE]" not in body


@pytest.mark.parametrize("stream", [False, True])
async def test_wrong_type(client: Client, stream: bool) -> None:
    await client.post("/sim/faults", json={"mode": "wrong_type"})
    status, ctype, body = await _post(client, "/v1/chat/completions", stream=stream)
    assert status == 200 and ctype.startswith("text/html") and body.startswith(b"<!doctype html>")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_huge(client: Client, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(garbage_module, "HUGE_BYTES", 10 * 64 * 1024)  # the shape, not the size, in process
    await client.post("/sim/faults", json={"mode": "huge"})
    status, ctype, body = await _post(client, path, stream=False)
    assert status == 200 and ctype.startswith("application/json")
    assert len(body) >= 10 * 64 * 1024 and _json_ok(body)  # well-formed, only too large
    status, ctype, body = await _post(client, path, stream=True)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    sizes = [len(e) for e in events]
    assert max(sizes) >= 10 * 64 * 1024 and sizes.index(max(sizes)) == len(events) - 2
    for event in events[:-1]:
        msgspec.json.decode(event.removeprefix(b"data: "))  # every event well-formed


async def test_garbage_leaves_health_and_other_routes_alone(client: Client) -> None:
    await client.post("/sim/faults", json={"mode": "wrong_type"})
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/v1/models")).json()["data"][0]["id"] == "m"
    await client.post("/sim/faults", json={"mode": "none"})
    status, _, body = await _post(client, "/v1/completions", stream=False)
    assert status == 200 and _json_ok(body)
