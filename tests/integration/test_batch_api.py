"""The Files and Batch API through the official ``openai`` SDK against real gateway processes (SQLite
and PostgreSQL): upload, list, download, delete; create, retrieve, list with pagination, cancel;
input files with bad lines make failed batches that name the lines; no tenant sees another's files
or batches (404, never 403).

These gateways run no batch worker (``SWITCHYARD_BATCH_WORKER=false``), so batches stay where the API
put them: this file tests the API, ``test_batch_worker.py`` the running of lines.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.integration.conftest import Engines, Gateway, http_json, start_gateway, stop

EP = "/v1/chat/completions"
#: The gateways' file limit: above their request body limit (1 MB), which uploads do not obey.
MAX_FILE = 2_000_000


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def gw(request: pytest.FixtureRequest, engines: Engines, tmp_path_factory: pytest.TempPathFactory,
       pg_database: Callable[[], str]) -> Iterator[Gateway]:
    """A gateway without batch worker, with keys of two tenants: ``a`` (pro) and ``b`` (free)."""
    data_dir = tmp_path_factory.mktemp(f"batch-api-{request.param}")
    url = f"sqlite:///{data_dir / 'switchyard.db'}" if request.param == "sqlite" else pg_database()
    gateway = start_gateway(engines, url, data_dir, request.param,
                            extra_env={"SWITCHYARD_BATCH_WORKER": "false",
                                       "SWITCHYARD_BATCH_MAX_FILE_BYTES": str(MAX_FILE)})
    try:
        gateway.keys = {"a": gateway.new_key("batch-a", "pro"), "b": gateway.new_key("batch-b", "free")}
        yield gateway
    finally:
        assert stop(gateway.proc), "the gateway must stop cleanly on SIGTERM"


def sdk(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys.get(key, key), max_retries=0, timeout=60)


def line(custom_id: str, url: str = EP, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "small", "max_tokens": 3, "messages": [{"role": "user", "content": custom_id}], **body}}


def jsonl(*lines: Any) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def upload(client: openai.OpenAI, content: bytes, name: str = "requests.jsonl") -> Any:
    return client.files.create(file=(name, content, "application/jsonl"), purpose="batch")


def test_the_sdk_batch_workflow(gw: Gateway) -> None:
    client = sdk(gw, "a")
    content = jsonl(line("first"), line("second"), line("third"))
    uploaded = upload(client, content)
    assert (uploaded.object, uploaded.purpose, uploaded.filename, uploaded.bytes) == (
        "file", "batch", "requests.jsonl", len(content))
    assert client.files.retrieve(uploaded.id) == uploaded
    assert client.files.content(uploaded.id).content == content
    assert uploaded.id in [f.id for f in client.files.list()]

    batch = client.batches.create(input_file_id=uploaded.id, endpoint=EP, completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.id.startswith("batch_") and batch.object == "batch"
    assert (batch.status, batch.endpoint, batch.input_file_id, batch.completion_window) == (
        "in_progress", EP, uploaded.id, "24h")
    assert batch.request_counts is not None
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 0}
    assert batch.metadata == {"job": "nightly"} and batch.errors is None
    assert batch.in_progress_at == batch.created_at and batch.expires_at == batch.created_at + 24 * 3600
    assert batch.output_file_id is None and batch.error_file_id is None
    assert client.batches.retrieve(batch.id) == batch  # nothing runs it here: still in progress
    assert batch.id in [b.id for b in client.batches.list()]

    # Nothing is running: cancelled at once; the lines that never ran are in the error file, by custom_id.
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelling_at and cancelled.cancelled_at
    assert cancelled.request_counts is not None
    assert cancelled.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 0}
    assert cancelled.output_file_id is None and cancelled.error_file_id is not None
    errors = [json.loads(x) for x in client.files.content(cancelled.error_file_id).content.splitlines()]
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
        ("first", None, "batch_cancelled"), ("second", None, "batch_cancelled"), ("third", None, "batch_cancelled")]
    assert all(e["id"].startswith("batch_req_") for e in errors)
    assert client.files.retrieve(cancelled.error_file_id).purpose == "batch_output"
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change

    # Deleting the input file leaves the batch alone.
    deleted = client.files.delete(uploaded.id)
    assert (deleted.id, deleted.deleted) == (uploaded.id, True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.files.delete(uploaded.id)
    assert client.batches.retrieve(batch.id).status == "cancelled"


def test_lists_are_paginated_newest_first(gw: Gateway) -> None:
    client = sdk(gw, gw.new_key("batch-pages", "pro"))
    source = upload(client, jsonl(line("x")))
    made = [client.batches.create(input_file_id=source.id, endpoint=EP, completion_window="24h").id
            for _ in range(5)]
    newest_first = made[::-1]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == newest_first[:2] and page.has_more
    assert [b.id for b in client.batches.list(limit=2)] == newest_first  # the SDK follows `after`
    status, _, body = http_json("GET", f"{gw.base_url}/v1/batches?limit=2&after={newest_first[3]}",
                                headers={"Authorization": f"Bearer {client.api_key}"})
    assert status == 200
    assert {k: body[k] for k in ("object", "first_id", "last_id", "has_more")} == {
        "object": "list", "first_id": newest_first[4], "last_id": newest_first[4], "has_more": False}
    status, _, body = http_json("GET", f"{gw.base_url}/v1/batches?limit=101",
                                headers={"Authorization": f"Bearer {client.api_key}"})
    assert status == 400 and body["error"]["param"] == "limit"

    more = [upload(client, jsonl(line("y")), f"f{i}.jsonl").id for i in range(2)]
    files = client.files.list(limit=2)
    assert [f.id for f in files.data] == more[::-1] and files.has_more
    assert [f.id for f in client.files.list(limit=2)] == [*more[::-1], source.id]
    assert [f.id for f in client.files.list(order="asc")] == [source.id, *more]
    assert [f.id for f in client.files.list(purpose="batch_output")] == []


def test_bad_input_files_make_failed_batches_that_name_the_lines(gw: Gateway) -> None:
    client = sdk(gw, "a")
    content = jsonl(line("ok"), b'{"custom_id": "broken", "method": "POST"', line("ok"),
                    line("elsewhere", url="/v1/completions"),
                    {"custom_id": "no-model", "method": "POST", "url": EP, "body": {"messages": []}})
    batch = client.batches.create(input_file_id=upload(client, content).id, endpoint=EP, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
    assert batch.request_counts is not None and batch.request_counts.total == 0
    assert batch.errors is not None and batch.errors.object == "list" and batch.errors.data is not None
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
        (2, "invalid_json_line", None), (3, "duplicate_custom_id", "custom_id"), (4, "url_mismatch", "url"),
        (5, "missing_required_parameter", "body.model")]
    assert all(e.message for e in batch.errors.data)
    assert client.batches.retrieve(batch.id) == batch

    empty = client.batches.create(input_file_id=upload(client, b"\n").id, endpoint=EP, completion_window="24h")
    assert empty.status == "failed" and empty.errors is not None and empty.errors.data is not None
    assert [e.code for e in empty.errors.data] == ["empty_file"]


def test_bad_requests_are_refused(gw: Gateway) -> None:
    client = sdk(gw, "a")
    good = upload(client, jsonl(line("x")))
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(input_file_id=good.id, endpoint="/v1/moderations", completion_window="24h")
    assert bad.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(input_file_id=good.id, endpoint=EP, completion_window="1h")  # type: ignore[arg-type]
    assert bad.value.body["param"] == "completion_window"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint=EP, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("x.jsonl", b"{}\n", "application/jsonl"), purpose="fine-tune")
    assert bad.value.body["param"] == "purpose"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        sdk(gw, "sk-sy-not-a-key").files.list()

    # Uploads have their own limit, above the gateway's request body limit (1 MB).
    big_line = json.dumps(line("big", padding="x" * 200_000)).encode()
    allowed = upload(client, b"\n".join([big_line] * 7))  # ~1.4 MB
    assert allowed.bytes > 1_000_000
    with pytest.raises(openai.APIStatusError) as too_big:
        upload(client, b"\n".join([big_line] * 11))  # ~2.2 MB
    assert too_big.value.status_code == 413


def test_no_tenant_sees_another_tenants_files_or_batches(gw: Gateway) -> None:
    owner, stranger = sdk(gw, "a"), sdk(gw, "b")
    uploaded = upload(owner, jsonl(line("mine")))
    batch = owner.batches.create(input_file_id=uploaded.id, endpoint=EP, completion_window="24h")
    cancelled = owner.batches.create(input_file_id=uploaded.id, endpoint=EP, completion_window="24h")
    output_id = owner.batches.cancel(cancelled.id).error_file_id
    assert output_id is not None

    for file_id in (uploaded.id, output_id):
        for call in (stranger.files.retrieve, stranger.files.content, stranger.files.delete):
            with pytest.raises(openai.NotFoundError):
                call(file_id)
    with pytest.raises(openai.NotFoundError):
        stranger.batches.create(input_file_id=uploaded.id, endpoint=EP, completion_window="24h")
    for call in (stranger.batches.retrieve, stranger.batches.cancel):  # type: ignore[assignment]
        with pytest.raises(openai.NotFoundError):
            call(batch.id)
    seen_files = {f.id for f in stranger.files.list()}
    seen_batches = {b.id for b in stranger.batches.list()}
    assert not seen_files & {uploaded.id, output_id} and not seen_batches & {batch.id, cancelled.id}
    with pytest.raises(openai.NotFoundError):
        stranger.batches.list(after=batch.id)
    with pytest.raises(openai.NotFoundError):
        stranger.files.list(after=uploaded.id)

    # The owner's things are untouched.
    assert owner.files.retrieve(uploaded.id).id == uploaded.id
    assert owner.batches.retrieve(batch.id).status == "in_progress"
