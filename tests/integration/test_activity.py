"""Recent activity end to end: requests sent with the official SDK show up in ``/admin/api/requests`` and are
counted in ``/admin/api/activity``.

The records live in the gateway process's memory, not in the database, so one gateway (on SQLite)
of this module's own is enough; it has the admin token set, which the admin API asks for.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.integration.conftest import (
    ADMIN_AUTH,
    ADMIN_TOKEN,
    Engines,
    Gateway,
    eventually,
    http_json,
    start_gateway,
    stop,
)

SECRET_PROMPT = "zebra-quartz-7 say something"


@pytest.fixture(scope="module")
def gw(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    data_dir = tmp_path_factory.mktemp("gw-activity")
    gateway = start_gateway(engines, f"sqlite:///{data_dir / 'switchyard.db'}", data_dir, "sqlite",
                            extra_env={"SWITCHYARD_ADMIN_TOKEN": ADMIN_TOKEN})
    try:
        gateway.keys = {"pro": gateway.new_key("activity-co", "pro")}
        yield gateway
    finally:
        assert stop(gateway.proc)


def admin(gw: Gateway, path: str, **params: Any) -> tuple[int, Any]:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    status, _, body = http_json("GET", f"{gw.base_url}/admin/api{path}" + (f"?{query}" if query else ""),
                                headers=ADMIN_AUTH)
    return status, body



def record(gw: Gateway, rid: str, done: Callable[[dict[str, Any]], bool] = lambda _r: True) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        status, body = admin(gw, f"/requests/{rid}")
        return body if status == 200 and done(body) else None

    got = eventually(found)
    assert got, f"request {rid} was not recorded"
    return got  # type: ignore[no-any-return]


def test_requests_are_recorded_filtered_and_counted(gw: Gateway) -> None:
    run = uuid.uuid4().hex[:8]
    sdk = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=gw.keys["pro"], max_retries=0, timeout=60)
    before = admin(gw, "/activity", window=300)[1]["total"]["requests"]

    ok = sdk.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": SECRET_PROMPT}], max_tokens=6,
        extra_headers={"x-request-id": f"ok-{run}"})
    assert ok.parse().choices[0].message.content
    streamed = sdk.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True})
    stream_id = streamed.headers["x-request-id"]  # the gateway's own id
    chunks = list(streamed.parse())
    assert chunks[-1].usage is not None
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                                    extra_headers={"x-request-id": f"unknown-{run}"})
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=-1,
                                    extra_headers={"x-request-id": f"bad-{run}"})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="sk-not-a-real-key-" + run, max_retries=0).chat \
            .completions.create(model="small", messages=[{"role": "user", "content": "hi"}],
                                extra_headers={"x-request-id": f"nokey-{run}"})

    # One request, as /requests/{id} has it: what was asked, where it went, and why.
    served = record(gw, f"ok-{run}", lambda r: r["completion_tokens"] is not None)
    route = ok.headers["x-switchyard-route"]
    parts = dict(p.split("=", 1) for p in route.split("; "))
    assert served["request_id"] == ok.headers["x-request-id"] == f"ok-{run}"
    assert (served["status"], served["outcome"], served["kind"], served["stream"]) == (200, "ok", "chat", False)
    assert (served["tenant"], served["tier"], served["model"], served["served_model"]) == (
        "activity-co", "pro", "small", "small")
    assert (served["pool"], served["endpoint"]) == (parts["pool"], parts["endpoint"])
    assert served["region"] == parts["region"] and served["priority"] == "standard"
    assert served["attempts"] == 1 and served["moved_on"] == []
    assert served["ttft_ms"] > 0 and served["duration_ms"] >= served["ttft_ms"]
    assert served["completion_tokens"] == 6 and served["prompt_tokens"] > 0
    assert served["cache"] == "none"
    assert "model small requested directly" in served["trace"]
    assert any(t.startswith("class standard") for t in served["trace"])
    assert served["trace"][-1] == f"route: {route}"
    assert served["time"].endswith("Z") and served["key_id"] and served["tenant_id"]

    stream = record(gw, stream_id, lambda r: r["completion_tokens"] is not None)
    assert (stream["status"], stream["stream"], stream["model"], stream["resolved_model"]) == (200, True, "auto",
                                                                                               "small")
    assert stream["ttft_ms"] is not None and stream["completion_tokens"] == 8
    assert any(t.startswith("route auto: rule short matched") for t in stream["trace"])
    assert stream["trace"][-1] == f"route: {streamed.headers['x-switchyard-route']}"

    unknown = record(gw, f"unknown-{run}")
    assert (unknown["status"], unknown["outcome"], unknown["error_code"]) == (404, "refused", "model_not_found")
    assert unknown["pool"] is None and unknown["model"] == "no-such-model" and unknown["tenant"] == "activity-co"
    bad = record(gw, f"bad-{run}")
    assert (bad["status"], bad["model"], bad["tenant"]) == (400, "small", "activity-co")
    nokey = record(gw, f"nokey-{run}")
    assert (nokey["status"], nokey["tenant"], nokey["key_id"]) == (401, None, None)

    # The list, newest first, and its filters.
    status, body = admin(gw, "/requests", tenant="activity-co")
    assert status == 200
    mine = [r["request_id"] for r in body["requests"]]
    assert mine[:4] == [f"bad-{run}", f"unknown-{run}", stream_id, f"ok-{run}"]
    assert [r["request_id"] for r in admin(gw, "/requests", tenant="activity-co", status="4xx")[1]["requests"]][:2] \
        == [f"bad-{run}", f"unknown-{run}"]
    assert all(r["status"] == 200 for r in admin(gw, "/requests", tenant="activity-co", status="200")[1]["requests"])
    assert [r["request_id"] for r in admin(gw, "/requests", model="no-such-model")[1]["requests"]] == [
        f"unknown-{run}"]
    assert [r["request_id"] for r in admin(gw, "/requests", tenant="activity-co", limit=1)[1]["requests"]] == [
        f"bad-{run}"]
    assert admin(gw, "/requests", tenant="nobody-at-all")[1]["requests"] == []
    status, error = admin(gw, "/requests", status="teapot")
    assert status == 400 and error["error"]["param"] == "status"
    status, error = admin(gw, f"/requests/never-{run}")
    assert status == 404 and set(error["error"]) == {"message", "type", "param", "code"}

    # Nothing secret is kept: not the key, not the prompt.
    text = json.dumps(admin(gw, "/requests", limit=500)[1])
    assert gw.keys["pro"] not in text and "sk-not-a-real-key" not in text and "zebra-quartz" not in text

    # The summary counts them (the 401 included: it is a finished request too).
    status, summary = admin(gw, "/activity", window=300)
    assert status == 200 and summary["window_s"] == 300 and summary["point_s"] == 10
    total = summary["total"]
    assert total["requests"] >= before + 5
    assert total["ok"] >= 2 and total["ttft_p50_ms"] is not None and total["ttft_p99_ms"] >= total["ttft_p50_ms"]
    assert len(total["series"]["requests_per_s"]) == 30 and total["series"]["requests_per_s"][-1] > 0
    pools = {row["pool"]: row for row in summary["pools"]}
    assert pools[served["pool"]]["requests"] >= 1
    assert pools[stream["pool"]]["ttft_p50_ms"] is not None  # TTFT is a stream's (the first byte of a whole answer
    # is all of it)
    assert pools["-"]["requests"] >= 3 and pools["-"]["error_rate"] is not None
    assert admin(gw, "/activity", window=0)[0] == 400


def test_the_admin_api_lists_the_activity_routes(gw: Gateway) -> None:
    status, _, doc = http_json("GET", f"{gw.base_url}/openapi/openapi.json")
    assert status == 200
    ops = {op["operationId"]: path for path, item in doc["paths"].items() for op in item.values()}
    assert ops["adminActivity"] == "/admin/api/activity" and ops["adminRequests"] == "/admin/api/requests"
    assert ops["adminRequest"] == "/admin/api/requests/{request_id}"
