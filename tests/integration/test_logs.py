"""JSON logs of a real gateway: every line one object, one line per request with the id the client got."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.conftest import Engines, Gateway, client, eventually, start_gateway, stop

SECRET_PROMPT = "ocelot-sapphire-42 tell me a story"


@pytest.fixture(scope="module")
def logged(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Path]]:
    data_dir = tmp_path_factory.mktemp("gw-logs")
    log_file = data_dir / "gateway.log"
    gateway = start_gateway(engines, f"sqlite:///{data_dir / 'switchyard.db'}", data_dir, "sqlite",
                            extra_env={"SWITCHYARD_LOG_FORMAT": "json", "SWITCHYARD_LOG_REQUESTS": "true",
                                       "SWITCHYARD_LOG_LEVEL": "info"}, log_file=log_file)
    try:
        gateway.keys = {"pro": gateway.new_key("logs-co", "pro")}
        yield gateway, log_file
    finally:
        assert stop(gateway.proc)


def lines(log_file: Path) -> list[dict[str, Any]]:
    """Every line of the log, each of which must be a JSON object."""
    out = []
    for number, line in enumerate(log_file.read_text().splitlines(), 1):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"line {number} of the gateway's log is not JSON: {line!r}") from None
        assert isinstance(data, dict) and {"time", "level", "logger", "message"} <= data.keys(), line
        out.append(data)
    return out


def test_each_request_is_one_json_line_with_the_id_the_client_got(logged: tuple[Gateway, Path]) -> None:
    gw, log_file = logged
    ok = client(gw, "pro").chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": SECRET_PROMPT}], max_tokens=5)
    rid = ok.headers["x-request-id"]
    bad = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        bad.chat.completions.create(model="small", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    refused_rid = refused.value.response.headers["x-request-id"]

    def both() -> dict[str, dict[str, Any]] | None:
        found = {x["request_id"]: x for x in lines(log_file) if x["logger"] == "switchyard.requests"}
        return found if rid in found and refused_rid in found else None

    found = eventually(both)
    assert found, "no request line for the two requests"
    served = found[rid]
    assert served["status"] == 200 and served["outcome"] == "ok" and served["tenant"] == "logs-co"
    assert served["served_model"] == "small" and served["pool"] and served["duration_ms"] > 0
    assert found[refused_rid]["status"] == 401 and found[refused_rid]["outcome"] == "refused"
    text = log_file.read_text()
    assert SECRET_PROMPT not in text and gw.keys["pro"] not in text and "sk-not-a-key" not in text
    # The start-up lines (uvicorn's included) are JSON too.
    uvicorns = [x for x in lines(log_file) if x["logger"].startswith("uvicorn")]
    assert uvicorns and not any("color_message" in x for x in uvicorns)
