"""Console page: batches (``/admin/batches``), on SQLite and PostgreSQL: every tenant's batches with their
counts and progress, filters and paging, one batch with its input errors and failed lines, cancelling
(operator, audited), and the htmx partials the pages poll."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from html import unescape
from pathlib import Path
from typing import Any, TypeVar

import pytest
from litestar.testing import TestClient
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.app import create_app
from switchyard.batch.intake import create_batch
from switchyard.settings import Settings
from switchyard.store import db
from switchyard.store.audit import list_events
from switchyard.store.batch_finalize import finalize_ready
from switchyard.store.batch_queue import claim, record_result
from switchyard.store.batches import get_batch
from switchyard.store.files import create_file
from switchyard.store.keys import create_key, list_keys
from switchyard.store.models import Batch, TenantCreate
from switchyard.store.tenants import create_tenant, get_tenant
from tests.integration.conftest import ADMIN_TOKEN, add_console_users, console_login, csrf_headers
from tests.unit.policy.base import base, to_yaml

T = TypeVar("T")
EP = "/v1/chat/completions"


def line(custom_id: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": EP,
            "body": {"model": "small", "messages": [{"role": "user", "content": "hi"}]}}


def jsonl(*lines: Any) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def tx(engine: Engine, work: Callable[[Session], T]) -> T:
    with db.session_scope(engine) as s:
        return work(s)


@pytest.fixture
def console(tmp_path: Path, database_url: str) -> Iterator[TestClient[Any]]:
    """An in-process app without a batch worker (the lines stay where the tests put them), tenants acme and
    globex with a key each, the three console users, logged in as the admin."""
    policy = tmp_path / "policies.yaml"
    policy.write_text(to_yaml(base()))
    settings = Settings(data_dir=tmp_path, database_url=database_url, policy_file=policy, admin_token=ADMIN_TOKEN,
                        batch_worker=False)
    with TestClient(app=create_app(settings)) as c:
        with db.session_scope(c.app.state.runtime.engine) as session:
            for name in ("acme", "globex"):
                create_tenant(session, TenantCreate(name=name, tier="free"))
                create_key(session, name)
        add_console_users(c.app.state.runtime.engine)
        assert console_login(c, "admin").status_code == 303
        yield c


def engine_of(client: TestClient[Any]) -> Engine:
    engine: Engine = client.app.state.runtime.engine
    return engine


def new_batch(client: TestClient[Any], tenant: str, content: bytes) -> Batch:
    """A batch of ``tenant`` over a new file of ``content`` (validated as the API would)."""
    def make(s: Session) -> Batch:
        tenant_id = get_tenant(s, tenant).id
        assert tenant_id is not None
        key_id = list_keys(s, tenant)[0].id
        f = create_file(s, tenant_id, "in.jsonl", content)
        return create_batch(s, tenant_id=tenant_id, key_id=key_id, input_file_id=f.id, endpoint=EP)

    return tx(engine_of(client), make)


def run_two(client: TestClient[Any]) -> None:
    """A worker's turn: two lines claimed, one succeeds and one fails with an engine's error."""
    def work(s: Session) -> None:
        first, second = claim(s, "test-worker", 2, 60, datetime.now(UTC))
        record_result(s, first.id, "test-worker", 200, {"id": "x", "choices": []}, None, datetime.now(UTC))
        record_result(s, second.id, "test-worker", 503, {"error": {"message": "engine overloaded"}}, None,
                      datetime.now(UTC))

    tx(engine_of(client), work)


def assert_clean(html: str) -> None:
    """No inline style or script (the console's CSP forbids them)."""
    assert 'style="' not in html and "<style" not in html
    assert all('src="' in tag for tag in re.findall(r"<script[^>]*>", html))
    assert not re.search(r"\son[a-z]+=", html)


def test_the_list_shows_every_tenants_batches_with_counts_and_progress(console: TestClient[Any]) -> None:
    running = new_batch(console, "acme", jsonl(*(line(f"r{i}") for i in range(4))))
    refused = new_batch(console, "globex", jsonl(line("a"), b"not json"))
    run_two(console)
    page = console.get("/admin/batches")
    assert page.status_code == 200
    html = page.text
    assert_clean(html)
    assert 'id="batches-filter"' in html and 'id="batches"' in html
    assert 'href="/admin/batches" aria-current="page"' in html  # in the navigation
    row = re.search(rf'<tr id="batch-{running.id}".*?</tr>', html, re.S)
    assert row is not None
    assert "acme" in row[0] and "in_progress" in row[0] and EP in row[0]
    assert "1 / 1 / 4" in row[0]
    bar = re.search(rf'<svg id="batch-progress-{running.id}"[^>]*>', row[0])
    assert bar is not None and 'role="img"' in bar[0]
    assert 'aria-label="1 completed, 1 failed of 4 requests (50% finished)"' in bar[0]
    assert 'width="25.0"' in row[0]
    other = re.search(rf'<tr id="batch-{refused.id}".*?</tr>', html, re.S)
    assert other is not None and "globex" in other[0] and "failed" in other[0]
    assert html.index(f"batch-{refused.id}") < html.index(f"batch-{running.id}")  # newest first
    # the table polls itself: an htmx request gets just the table
    assert 'hx-get="/admin/batches"' in html and 'hx-trigger="every 5s"' in html
    partial = console.get("/admin/batches", headers={"HX-Request": "true"})
    assert partial.status_code == 200 and "<html" not in partial.text and f'id="batch-{running.id}"' in partial.text


def test_filters_and_paging(console: TestClient[Any]) -> None:
    acme = [new_batch(console, "acme", jsonl(line("a"))) for _ in range(3)]
    globex = new_batch(console, "globex", jsonl(line("a")))
    refused = new_batch(console, "acme", b"{}\n")
    html = console.get("/admin/batches", params={"tenant": "acme"}).text
    assert all(f"batch-{x.id}" in html for x in [*acme, refused]) and f"batch-{globex.id}" not in html
    assert '<option value="acme" selected>' in html
    html = console.get("/admin/batches", params={"status": "failed"}).text
    assert f"batch-{refused.id}" in html and not any(f"batch-{x.id}" in html for x in [*acme, globex])
    assert '<option value="failed" selected>' in html
    html = console.get("/admin/batches", params={"tenant": "globex", "status": "in_progress"}).text
    assert f"batch-{globex.id}" in html and f"batch-{acme[0].id}" not in html
    # two a page, then older
    html = console.get("/admin/batches", params={"tenant": "acme", "limit": "2"}).text
    shown = re.findall(r'<tr id="batch-(batch_[0-9a-f]+)"', html)
    assert shown == [refused.id, acme[2].id]
    older = re.search(r'id="batches-older" href="([^"]+)"', html)
    assert older is not None
    html = console.get(older[1].replace("&amp;", "&")).text
    assert re.findall(r'<tr id="batch-(batch_[0-9a-f]+)"', html) == [acme[1].id, acme[0].id]
    assert 'id="batches-older"' not in html and 'id="batches-newest"' in html
    # bad filters are a 400 with an alert
    for params in ({"status": "bogus"}, {"tenant": "nobody"}, {"limit": "0"}, {"before": "batch_nope"}):
        answer = console.get("/admin/batches", params=params)
        assert answer.status_code == 400, params
        assert 'role="alert"' in answer.text
    assert 'id="batches-empty"' in console.get("/admin/batches", params={"status": "expired"}).text


def test_the_detail_page_shows_fields_states_and_failed_lines(console: TestClient[Any]) -> None:
    batch = new_batch(console, "acme", jsonl(*(line(f"r{i}") for i in range(3))))
    run_two(console)
    page = console.get(f"/admin/batches/{batch.id}")
    assert page.status_code == 200
    html = page.text
    assert_clean(html)
    assert 'id="batch-detail"' in html and "acme" in html and batch.input_file_id in html
    assert f'id="batch-progress-{batch.id}"' in html and "1 completed, 1 failed of 3" in html
    for state, count in (("pending", 1), ("running", 0), ("succeeded", 1), ("failed", 1)):
        assert re.search(rf'id="batch-state-{state}"><th scope="row">{state}</th><td class="num">{count}</td>', html)
    failed = re.search(r'<table id="batch-failed".*?</table>', html, re.S)
    assert failed is not None and "engine overloaded" in failed[0] and "503" in failed[0]
    assert 'id="batch-cancel-form"' in html and 'name="_csrf_token"' in html
    # it polls while it runs; htmx gets just the part that changes
    assert f'hx-get="/admin/batches/{batch.id}"' in html
    partial = console.get(f"/admin/batches/{batch.id}", headers={"HX-Request": "true"})
    assert partial.status_code == 200 and "<html" not in partial.text and 'id="batch-detail"' in partial.text


def test_a_refused_batch_shows_its_input_errors_with_line_numbers(console: TestClient[Any]) -> None:
    bad = {**line("b"), "url": "/v1/embeddings"}
    batch = new_batch(console, "acme", jsonl(line("a"), b"{oops", bad))
    html = console.get(f"/admin/batches/{batch.id}").text
    assert_clean(html)
    errors = re.search(r'<table id="batch-errors".*?</table>', html, re.S)
    assert errors is not None
    rows = re.findall(r'<tr><td class="num">(\d+)</td><td><code>([a-z_]+)</code>', errors[0])
    assert rows == [("2", "invalid_json_line"), ("3", "url_mismatch")]
    assert 'id="batch-cancel-form"' not in html  # nothing to cancel
    assert "hx-trigger" not in html.split('id="batch-detail"')[1].split(">")[0]  # an ended batch stops polling


def test_an_operator_cancels_a_batch_and_it_is_audited(console: TestClient[Any]) -> None:
    batch = new_batch(console, "acme", jsonl(line("a"), line("b")))
    console.cookies.clear()
    assert console_login(console, "operator").status_code == 303
    answer = console.post(f"/admin/batches/{batch.id}/cancel", headers=csrf_headers(console), follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == f"/admin/batches/{batch.id}"
    html = console.get(answer.headers["location"]).text
    assert 'id="batch-status">cancelled<' in html and 'id="batch-cancel-form"' not in html
    tenant_id = batch.tenant_id
    assert tx(engine_of(console), lambda s: get_batch(s, tenant_id, batch.id)).status == "cancelled"
    events = tx(engine_of(console), lambda s: list_events(s, 10, "batch.cancel"))
    assert len(events) == 1
    event = events[0]
    assert (event.actor, event.target) == ("console:otto", f"batch:{batch.id}")
    assert event.detail == {"tenant": "acme", "previous": "in_progress", "status": "cancelled"}
    # once ended, another cancel is refused on the page and not audited
    again = console.post(f"/admin/batches/{batch.id}/cancel", headers=csrf_headers(console), follow_redirects=False)
    assert again.status_code == 409 and 'role="alert"' in again.text and "already cancelled" in again.text
    refused = new_batch(console, "acme", b"{}\n")
    answer = console.post(f"/admin/batches/{refused.id}/cancel", headers=csrf_headers(console),
                          follow_redirects=False)
    assert answer.status_code == 409 and 'id="batch-error" class="alert" role="alert"' in answer.text
    assert "Cannot cancel a batch with status 'failed'" in unescape(answer.text)
    assert len(tx(engine_of(console), lambda s: list_events(s, 10, "batch.cancel"))) == 1


def test_a_viewer_reads_but_cannot_cancel(console: TestClient[Any]) -> None:
    batch = new_batch(console, "acme", jsonl(line("a")))
    console.cookies.clear()
    assert console_login(console, "viewer").status_code == 303
    html = console.get(f"/admin/batches/{batch.id}").text
    assert batch.id in html and 'id="batch-cancel-form"' not in html
    answer = console.post(f"/admin/batches/{batch.id}/cancel", headers=csrf_headers(console), follow_redirects=False)
    assert answer.status_code == 403
    assert tx(engine_of(console), lambda s: get_batch(s, batch.tenant_id, batch.id)).status == "in_progress"


def test_an_unknown_batch_is_a_404_page(console: TestClient[Any]) -> None:
    answer = console.get("/admin/batches/batch_nope")
    assert answer.status_code == 404 and 'id="batch-missing"' in answer.text and 'role="alert"' in answer.text
    assert_clean(answer.text)
    answer = console.post("/admin/batches/batch_nope/cancel", headers=csrf_headers(console), follow_redirects=False)
    assert answer.status_code == 404 and 'id="batch-missing"' in answer.text
    assert tx(engine_of(console), lambda s: list_events(s, 10, "batch.cancel")) == []


def _run_all(client: TestClient[Any], ok: int) -> None:
    """A worker's turn over every pending line: the first ``ok`` succeed, the rest fail; then the finalizer."""
    def work(s: Session) -> None:
        now = datetime.now(UTC)
        for i, claimed in enumerate(claim(s, "test-worker", 100, 60, now)):
            if i < ok:
                record_result(s, claimed.id, "test-worker", 200, {"id": "x", "choices": []}, None, now)
            else:
                record_result(s, claimed.id, "test-worker", 429, None, {"code": "rate_limit_exceeded",
                                                                        "message": "limit"}, now)
        finalize_ready(s, now)

    tx(engine_of(client), work)


@pytest.mark.parametrize(("ok", "badge", "kind"), [
    (3, "completed", "completed"),
    (1, "completed with 2 failed", "completed-with-failures"),
    (0, "completed, all 3 failed", "completed-all-failed"),
])
def test_a_completed_batch_with_failed_lines_says_so(console: TestClient[Any], ok: int, badge: str, kind: str) -> None:
    """OpenAI's status is ``completed`` whatever failed; the console's badge says how many did, not green."""
    batch = new_batch(console, "acme", jsonl(*(line(f"r{i}") for i in range(3))))
    _run_all(console, ok)
    assert get_batch_status(console, batch.id) == "completed"
    expected = f'<span class="badge batch-badge-{kind}">{badge}</span>'
    assert expected in console.get("/admin/batches").text
    assert expected in console.get(f"/admin/batches/{batch.id}").text


def get_batch_status(client: TestClient[Any], batch_id: str) -> str:
    return tx(engine_of(client), lambda s: s.get(Batch, batch_id).status)  # type: ignore[union-attr]
