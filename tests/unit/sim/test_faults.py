"""Fault settings: validation, draws, and the control app's targeting (in process)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from switchyard.sim.config import EngineConfig, resolve
from switchyard.sim.control import build_control_app, select, split_targets
from switchyard.sim.fault_client import describe
from switchyard.sim.faults import DEFAULTS, FaultError, FaultState, parse_settings
from switchyard.sim.runtime import EngineRuntime


@pytest.mark.parametrize(("body", "message"), [
    ([1], "expected a JSON object"),
    ({"colour": "red"}, "unknown fault settings: colour"),
    ({"mode": "error"}, "set error_rate instead"),
    ({"mode": "sideways"}, "mode must be one of none, slow, drip, hang, down, unavailable"),
    ({"mode": None}, "mode must be one of"),
    ({"error_rate": 1.5}, "error_rate must be within [0, 1]"),
    ({"throttle_rate": -0.1}, "throttle_rate must be within [0, 1]"),
    ({"overload_rate": float("nan")}, "overload_rate must be within [0, 1]"),
    ({"abort_rate": True}, "abort_rate must be a number"),
    ({"abort_rate": "0.5"}, "abort_rate must be a number"),
    ({"slow_factor": 0}, "slow_factor must be a finite number > 0"),
    ({"slow_factor": float("inf")}, "slow_factor must be a finite number > 0"),
    ({"abort_after_tokens": -1}, "abort_after_tokens must be an integer >= 0"),
    ({"abort_after_tokens": 2.5}, "abort_after_tokens must be an integer >= 0"),
    ({"abort_after_tokens": False}, "abort_after_tokens must be an integer >= 0"),
    ({"drip_interval_s": 0}, "drip_interval_s must be a finite number > 0, got 0.0"),
    ({"drip_interval_s": -1.5}, "drip_interval_s must be a finite number > 0"),
    ({"drip_interval_s": float("nan")}, "drip_interval_s must be a finite number > 0"),
    ({"drip_interval_s": "2"}, "drip_interval_s must be a number, got '2'"),
    ({"drip_interval_s": None}, "drip_interval_s must be a number"),
    ({"abort_with": "drop"}, "abort_with must be one of close, error; got 'drop'"),
    ({"abort_with": None}, "abort_with must be one of close, error; got None"),
    ({"mode": "drip", "abort_with": "ERROR"}, "abort_with must be one of close, error"),
    ({"mode": "drip", "drip_interval_s": 1, "color": 1}, "unknown fault settings: color (valid: mode, slow_factor, "
                                                         "drip_interval_s, error_rate"),
])
def test_invalid_settings_are_refused_and_change_nothing(body: object, message: str) -> None:
    state = FaultState()
    with pytest.raises(FaultError) as err:
        state.update(body)
    assert message in str(err.value)
    assert state.as_dict() == dict(DEFAULTS)


def test_partial_updates_keep_the_rest() -> None:
    state = FaultState()
    state.update({"mode": "slow", "slow_factor": 3, "error_rate": 0.5})
    state.update({"abort_rate": 1, "abort_after_tokens": 0})
    assert state.as_dict() == {"mode": "slow", "slow_factor": 3.0, "drip_interval_s": 2.0, "error_rate": 0.5,
                               "throttle_rate": 0.0, "overload_rate": 0.0, "abort_rate": 1.0, "abort_after_tokens": 0,
                               "abort_with": "close"}
    assert state.step_factor == 3.0
    state.update({})
    assert state.mode == "slow"
    assert parse_settings({"error_rate": 1}) == {"error_rate": 1.0}
    assert parse_settings({"drip_interval_s": 1, "abort_with": "error"}) == {"drip_interval_s": 1.0,
                                                                             "abort_with": "error"}
    state.update({"mode": "drip", "drip_interval_s": 0.25, "abort_with": "error"})
    assert (state.mode, state.drip_interval_s, state.abort_with, state.slow_factor) == ("drip", 0.25, "error", 3.0)
    assert state.step_factor == 1.0 and not state.hung  # a drip spaces steps out, it does not slow them
    state.update({"mode": "hang"})
    assert state.hung


async def test_a_change_wakes_whoever_waits_for_one() -> None:
    state = FaultState()
    waiting = asyncio.ensure_future(state.wait_changed())
    await asyncio.sleep(0)
    assert not waiting.done()
    with pytest.raises(FaultError):
        state.update({"mode": "nope"})  # a refused change is no change
    await asyncio.sleep(0)
    assert not waiting.done()
    state.update({"drip_interval_s": 3})
    await asyncio.wait_for(waiting, 1)


def test_rates_are_checked_in_order_and_only_in_modes_none_and_slow() -> None:
    state = FaultState()
    assert state.draw() is None
    state.update({"error_rate": 1, "throttle_rate": 1, "overload_rate": 1, "abort_rate": 1})
    assert state.draw() == "error"
    state.update({"error_rate": 0})
    assert state.draw() == "throttle"
    state.update({"throttle_rate": 0})
    assert state.draw() == "overload"
    state.update({"overload_rate": 0, "mode": "slow"})
    assert state.draw() == "abort"
    state.update({"mode": "drip"})  # a dripping engine still answers: its rates apply
    assert state.draw() == "abort"
    for mode in ("hang", "down", "unavailable"):
        state.update({"mode": mode})
        assert state.draw() is None
    assert state.counts == {"error": 1, "throttle": 1, "overload": 1, "abort": 2}


def test_draws_are_seeded_and_proportional() -> None:
    def draws(seed: int) -> list[str | None]:
        state = FaultState(seed)
        state.update({"throttle_rate": 0.3, "overload_rate": 0.5})
        return [state.draw() for _ in range(400)]

    first = draws(7)
    assert first == draws(7) and first != draws(8)
    assert 80 <= first.count("throttle") <= 160  # 0.3 of 400
    assert 100 <= first.count("overload") <= 180  # 0.5 of what throttle leaves


def _engines() -> list[EngineRuntime]:
    labels = [("us-east", "a-us", 9001), ("us-east", "a-us", 9002), ("eu-west", "a-eu", 9003), (None, None, 9004)]
    return [EngineRuntime(resolve(EngineConfig(served_model="m", port=port, region=region, pool=pool)))
            for region, pool, port in labels]


def test_targets_select_engines_matching_all_of_them() -> None:
    engines = _engines()

    def ports(body: dict[str, Any]) -> list[int]:
        return [e.config.port for e in select(engines, split_targets(body)[0])]

    assert ports({}) == [9001, 9002, 9003, 9004]
    assert ports({"region": "us-east"}) == [9001, 9002]
    assert ports({"pool": "a-eu", "mode": "down"}) == [9003]
    assert ports({"region": "us-east", "port": 9002}) == [9002]
    assert ports({"region": None, "port": 9004}) == [9004]
    with pytest.raises(FaultError, match=r"no engine matches region=eu-west, port=9001; regions: .*us-east"):
        ports({"region": "eu-west", "port": 9001})
    for bad, message in (({"port": "9001"}, "port must be an integer"), ({"port": True}, "port must be an integer"),
                         ({"region": 1}, "region must be a string"), ({"mode": "off"}, "mode must be one of"),
                         ({"pool": "a-us", "colour": 1}, "unknown fault settings: colour")):
        with pytest.raises(FaultError, match=message):
            split_targets(bad)


@pytest.fixture
async def control() -> AsyncIterator[tuple[AsyncTestClient, list[EngineRuntime]]]:  # type: ignore[type-arg]
    engines = _engines()
    async with AsyncTestClient(app=build_control_app(engines)) as client:
        yield client, engines


async def test_control_app_sets_faults_on_matching_engines(
        control: tuple[AsyncTestClient, list[EngineRuntime]]) -> None:  # type: ignore[type-arg]
    client, engines = control
    assert (await client.get("/health")).status_code == 200
    listed = (await client.get("/faults")).json()["engines"]
    assert listed[0] == {"url": "http://127.0.0.1:9001", "port": 9001, "model": "m", "pool": "a-us",
                         "region": "us-east", "listening": True, "faults": dict(DEFAULTS)}
    assert listed[3]["pool"] is None and listed[3]["region"] is None
    resp = await client.post("/faults", json={"region": "us-east", "mode": "unavailable", "throttle_rate": 0.5})
    assert resp.status_code == 200
    assert [(e["port"], e["faults"]["mode"], e["faults"]["throttle_rate"]) for e in resp.json()["engines"]] == [
        (9001, "unavailable", 0.5), (9002, "unavailable", 0.5)]
    assert [e.faults.mode for e in engines] == ["unavailable", "unavailable", "none", "none"]
    resp = await client.post("/faults", json={"pool": "a-eu", "mode": "drip", "drip_interval_s": 0.5,
                                              "abort_rate": 1, "abort_with": "error"})
    assert resp.status_code == 200
    assert [(e["port"], e["faults"]) for e in resp.json()["engines"]] == [
        (9003, {**DEFAULTS, "mode": "drip", "drip_interval_s": 0.5, "abort_rate": 1.0, "abort_with": "error"})]
    assert engines[2].faults.drip_interval_s == 0.5 and engines[3].faults.drip_interval_s == 2.0


async def test_control_app_changes_nothing_on_a_bad_request(
        control: tuple[AsyncTestClient, list[EngineRuntime]]) -> None:  # type: ignore[type-arg]
    client, engines = control
    for body in ({"region": "us-east", "mode": "down", "error_rate": 7}, {"pool": "nowhere", "mode": "down"},
                 {"mode": "error"}, {"region": "us-east", "mode": "drip", "drip_interval_s": 0},
                 {"port": 9001, "abort_rate": 1, "abort_with": "reset"}):
        resp = await client.post("/faults", json=body)
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "BadRequestError"
    resp = await client.post("/faults", content=b"{")
    assert resp.status_code == 400 and "not valid JSON" in resp.json()["error"]["message"]
    assert all(e.faults.as_dict() == dict(DEFAULTS) for e in engines)


def test_describe_is_one_line_with_every_setting() -> None:
    line = describe({"url": "http://127.0.0.1:9001", "pool": "a-us", "region": None, "listening": False,
                     "faults": {**DEFAULTS, "mode": "down", "error_rate": 0.25}})
    assert line == ("http://127.0.0.1:9001 pool=a-us region=- listening=no mode=down slow_factor=5 drip_interval_s=2 "
                    "error_rate=0.25 throttle_rate=0 overload_rate=0 abort_rate=0 abort_after_tokens=4 "
                    "abort_with=close")
