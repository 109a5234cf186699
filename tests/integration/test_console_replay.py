"""The policy editor's pre-publish replay ("What this change would do", ``/admin/policy/replay``): on a real
app over SQLite and PostgreSQL with request-log rows written to the database, and end to end through a
real gateway whose request log holds what the official SDK sent."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from sqlalchemy import Engine

from switchyard.admin.pages import policy_replay
from switchyard.app import create_app
from switchyard.decide import canary as rules
from switchyard.policy.rollout import Rollout
from switchyard.settings import Settings
from switchyard.store import canary as canary_store
from switchyard.store import db
from switchyard.store.models import RequestLogEntry
from switchyard.whatif.outcomes import NOT_MODELLED
from tests.integration.conftest import (
    Engines,
    add_console_users,
    client,
    console_login,
    csrf_headers,
    eventually,
    start_gateway,
    stop,
)
from tests.unit.policy.base import base, to_yaml

PAGE = "/admin/policy"
REPLAY = "/admin/policy/replay"
HTMX = {"HX-Request": "true"}
EMPTY = "The request log has no requests from the last hour to replay; publishing is still possible."


def _active() -> dict[str, Any]:
    """The test policy (``base()``) with ``small`` on one pool, ``small-us``, and no fallback, so that where a
    request goes changes only with what a candidate changes (with two pools, a refusal frees one and the
    picker can send a later request elsewhere)."""
    doc = base()
    doc["models"][0]["pools"] = ["small-us"]
    del doc["models"][0]["fallback"]
    return doc


V1 = to_yaml(_active())


@pytest.fixture
def db_console(tmp_path: Path, database_url: str) -> Iterator[TestClient[Any]]:
    """A gateway whose policy (:func:`_active`, v1) lives in the database, its console users, logged in as the
    operator."""
    policy = tmp_path / "policies.yaml"
    policy.write_text(V1)
    settings = Settings(data_dir=tmp_path, database_url=database_url, policy_file=policy, policy_source="db")
    with TestClient(app=create_app(settings)) as c:
        add_console_users(c.app.state.runtime.engine)
        assert console_login(c, "operator").status_code == 303
        yield c


def _engine(c: TestClient[Any]) -> Engine:
    engine: Engine = c.app.state.runtime.engine
    return engine


def _entry(at: datetime, n: int, tier: str | None, model: str, status: int = 200, prompt: int | None = 50,
           completion: int | None = 10, max_tokens: int | None = 10) -> RequestLogEntry:
    return RequestLogEntry(at=at, request_id=f"req-{n}", replica="test:1", kind="chat", tier=tier, model=model,
                           status=status, outcome="ok" if status == 200 else "limited", stream=False,
                           prompt_tokens=prompt, completion_tokens=completion if status == 200 else None,
                           cached_tokens=0, max_tokens=max_tokens, detail="{}")


def _write_log(c: TestClient[Any], entries: list[RequestLogEntry]) -> None:
    with db.session_scope(_engine(c)) as session:
        session.add_all(entries)


def _traffic(c: TestClient[Any]) -> None:
    """The log the figures below are predicted from (times relative to now):

    - 5 free requests for ``small`` a second apart, 50 prompt tokens each: all served by v1;
    - 4 pro requests for ``auto`` with 40-token prompts: v1's ``short`` rule sends them to ``small``;
    - 1 request whose key was refused (no tier): read, never replayed;
    - 1 pro request that was refused (429) when it ran: replayed as asked;
    - 1 free request two hours ago: outside the last hour, inside the last 24.
    """
    now = datetime.now(UTC)
    rows = [_entry(now - timedelta(seconds=50 - i), i, "free", "small") for i in range(5)]
    rows += [_entry(now - timedelta(seconds=40 - i), 10 + i, "pro", "auto", prompt=40, completion=8, max_tokens=8)
             for i in range(4)]
    rows.append(_entry(now - timedelta(seconds=30), 20, None, "small", status=401, prompt=None))
    rows.append(_entry(now - timedelta(seconds=29), 21, "pro", "small", status=429, prompt=30, max_tokens=5))
    rows.append(_entry(now - timedelta(hours=2), 30, "free", "small"))
    _write_log(c, rows)


def _replay(c: TestClient[Any], text: str, **form: str) -> str:
    answer = c.post(REPLAY, data={"yaml": text, **form}, headers={**csrf_headers(c), **HTMX})
    assert answer.status_code == 200, answer.text
    assert "<html" not in answer.text  # the panel, for htmx to swap in
    return answer.text


def _cells(page: str, row_id: str) -> list[str]:
    """The text of each cell (th and td) of the table row ``row_id``."""
    found = re.search(rf'<tr id="{re.escape(row_id)}">(.*?)</tr>', page, re.DOTALL)
    assert found is not None, (row_id, page)
    return [html.unescape(re.sub(r"<[^>]+>", "", cell)).strip()
            for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", found.group(1), re.DOTALL)]


def _text(page: str, element_id: str) -> str:
    found = re.search(rf'id="{re.escape(element_id)}"[^>]*>(.*?)</(?:p|dd|ul|div)>', page, re.DOTALL)
    assert found is not None, (element_id, page)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", found.group(1))).split())


def _items(page: str, list_id: str) -> list[str]:
    found = re.search(rf'<ul id="{re.escape(list_id)}">(.*?)</ul>', page, re.DOTALL)
    assert found is not None, (list_id, page)
    return [html.unescape(item) for item in re.findall(r"<li>(.*?)</li>", found.group(1), re.DOTALL)]


def _candidate(page: str) -> str:
    found = re.search(r'<textarea id="policy-editor"[^>]*>\n(.*?)</textarea>', page, re.DOTALL)
    assert found is not None, page
    return html.unescape(found.group(1))


def _short_prompts_to_large() -> str:
    """v1 with the ``auto`` route's ``short`` rule at 10 tokens: the pro requests' 40-token prompts go to large."""
    doc = _active()
    doc["routes"][0]["rules"][1]["when"]["prompt_tokens_lt"] = 10
    return to_yaml(doc)


def test_a_tier_limit_edit_shows_the_429s_it_would_cause_before_the_publish_button(
        db_console: TestClient[Any]) -> None:
    _traffic(db_console)
    editor = db_console.get(f"{PAGE}/edit").text  # the serving policy itself: nothing to replay
    assert 'id="replay-unchanged"' in editor and 'hx-post="/admin/policy/replay"' not in editor
    form = {"tier": "free", "tokens_per_minute": "1000", "requests_per_minute": "2", "tokens_per_day": "10000",
            "spend_per_month": ""}
    review = db_console.post(f"{PAGE}/edit/tier-limits", data=form, headers=csrf_headers(db_console))
    assert review.status_code == 200, review.text
    page = review.text
    # the check view itself does not replay: it carries a panel that htmx loads once the page is there
    panel = page.index('id="replay-heading">What this change would do</h2>')
    assert panel < page.index('<button id="publish"')
    assert re.search(r'<div id="replay-panel" hx-post="/admin/policy/replay" hx-trigger="load"', page)
    assert re.search(r'<section id="replay-[0-9a-f]{16}" class="replay"[^>]*hx-preserve="true"', page)
    assert 'id="replay-headline"' not in page

    text = _replay(db_console, _candidate(page))
    assert _text(text, "replay-placement") == (
        "3 of 10 requests change placement: 3 change model, 3 change pool, 3 change region.")
    #                                   tier   class        requests 429: active, candidate; 503; other
    assert _cells(text, "replay-refusals-free") == ["free", "sheddable", "5", "0", "3", "0", "0", "0", "0"]
    assert _cells(text, "replay-refusals-pro") == ["pro", "critical", "5", "0", "0", "0", "0", "0", "0"]
    assert _cells(text, "replay-headline-served") == ["served", "10", "7", "\u22123"]
    assert _cells(text, "replay-headline-refused") == ["refused or failed", "0", "3", "+3"]
    assert _cells(text, "replay-statuses-429") == ["429", "0", "3"]
    assert "Active (v1)" in text
    assert _text(text, "replay-entries").startswith("11 (")  # the two-hour-old entry is outside the window
    assert _text(text, "replay-requests") == "10"
    assert _text(text, "replay-skipped") == "1 with no tier (the API key was refused)"
    assert _text(text, "replay-refused-in-log").startswith("1 ")
    assert _items(text, "replay-not-modelled") == list(NOT_MODELLED)
    assert "10 requests from the request log of the last hour" in _text(text, "replay-summary")
    assert 'id="replay-capped"' not in text and 'id="replay-sampled"' not in text
    # the window selector offers the three windows, the last hour chosen
    assert '<option value="1h" selected>last hour</option>' in text
    assert '<option value="15m">' in text and '<option value="24h">' in text


def test_a_route_change_moves_placements_and_the_window_selects_the_log(db_console: TestClient[Any]) -> None:
    _traffic(db_console)
    text = _replay(db_console, _short_prompts_to_large())
    assert _text(text, "replay-placement") == (
        "4 of 10 requests change placement: 4 change model, 4 change pool, 0 change region.")
    assert _cells(text, "replay-moves-1") == ["small @ small-us (us-east)", "large @ large-us (us-east)", "4"]
    assert _cells(text, "replay-refusals-free")[3:] == ["0"] * 6  # nobody is refused either way
    assert [row[0] for row in (_cells(text, "replay-ttft-critical"), _cells(text, "replay-ttft-sheddable"))] == [
        "critical", "sheddable"]
    assert _cells(text, "replay-ttft-critical")[1:3] == ["5", "5"]  # served, both arms
    assert _cells(text, "replay-headline-served") == ["served", "10", "10", "same"]

    day = _replay(db_console, _short_prompts_to_large(), replay_window="24h")
    assert '<option value="24h" selected>last 24 hours</option>' in day
    assert _text(day, "replay-requests") == "11" and _text(day, "replay-entries").startswith("12 (")
    assert "11 requests from the request log of the last 24 hours" in _text(day, "replay-summary")
    bogus = _replay(db_console, V1, replay_window="forever")
    assert "Choose one of the offered windows" in bogus and 'id="replay-headline"' not in bogus


def test_an_empty_log_says_so_plainly(db_console: TestClient[Any]) -> None:
    text = _replay(db_console, _short_prompts_to_large())
    assert _text(text, "replay-message") == EMPTY
    assert 'id="replay-headline"' not in text and "<table" not in text
    # entries that cannot be replayed are named, not replayed
    _write_log(db_console, [_entry(datetime.now(UTC) - timedelta(minutes=3), 1, None, "small", status=401,
                                   prompt=None)])
    text = _replay(db_console, _short_prompts_to_large(), replay_window="15m")
    assert _text(text, "replay-message") == (
        "The request log has 1 request from the last 15 minutes, but none can be replayed "
        "(1 with no tier (the API key was refused)); publishing is still possible.")


def test_an_invalid_candidate_gets_a_short_message_not_a_replay(db_console: TestClient[Any]) -> None:
    _traffic(db_console)
    doc = _active()
    doc["tiers"][0]["priority"] = "nope"
    text = _replay(db_console, to_yaml(doc))
    assert _text(text, "replay-message") == (
        "The candidate is not valid (1 issue), so it was not replayed: fix it first.")
    assert 'role="alert"' in text and 'id="replay-headline"' not in text
    # and the check view offers no replay for it
    partial = db_console.post(f"{PAGE}/validate", data={"yaml": to_yaml(doc)}, headers={**csrf_headers(db_console),
                                                                                         **HTMX})
    assert partial.status_code == 200 and "replay-panel" not in partial.text


def test_an_engine_the_replay_cannot_simulate_is_said_in_the_panel_escaped(db_console: TestClient[Any]) -> None:
    _traffic(db_console)
    doc = _active()
    doc["pools"][0]["sim_profile"] = "<b>x</b>"
    text = _replay(db_console, to_yaml(doc))
    message = _text(text, "replay-message")
    assert message.startswith("The replay cannot simulate the policies' engines: pool small-us:")
    assert message.endswith("Publishing is still possible.")
    assert "<b>x</b>" not in text and "&lt;b&gt;x&lt;/b&gt;" in text


def test_only_the_newest_entries_up_to_the_cap_are_replayed(db_console: TestClient[Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _traffic(db_console)
    monkeypatch.setattr(policy_replay, "MAX_LOG_ENTRIES", 4)
    text = _replay(db_console, _short_prompts_to_large())
    assert "Only the newest 4 entries of the last hour were replayed" in _text(text, "replay-capped")
    # the newest four: two pro requests for auto, the one with no tier, the one refused in the log
    assert _text(text, "replay-entries").startswith("4 (")
    assert _text(text, "replay-requests") == "3"


def test_only_operators_replay_and_every_post_needs_the_csrf_token(db_console: TestClient[Any]) -> None:
    _traffic(db_console)
    candidate = _short_prompts_to_large()
    operator = db_console.post(f"{PAGE}/validate", data={"yaml": candidate},
                               headers={**csrf_headers(db_console), **HTMX})
    assert 'hx-post="/admin/policy/replay"' in operator.text

    # no CSRF token: refused like every console post, before anything runs
    refused = db_console.post(REPLAY, data={"yaml": candidate}, headers=HTMX)
    assert refused.status_code == 403 and "replay-placement" not in refused.text
    forged = db_console.post(REPLAY, data={"yaml": candidate}, headers={**HTMX, "x-csrftoken": "forged"})
    assert forged.status_code == 403

    assert console_login(db_console, "viewer").status_code == 303
    viewer = db_console.post(REPLAY, data={"yaml": candidate}, headers={**csrf_headers(db_console), **HTMX})
    assert viewer.status_code == 403 and "this needs the operator role" in viewer.text
    partial = db_console.post(f"{PAGE}/validate", data={"yaml": candidate},
                              headers={**csrf_headers(db_console), **HTMX})
    assert partial.status_code == 200  # a viewer still validates, and is told who can replay
    assert 'id="replay-needs-operator"' in partial.text and 'hx-post="/admin/policy/replay"' not in partial.text

    db_console.cookies.delete("switchyard_session")
    anonymous = db_console.post(REPLAY, data={"yaml": candidate}, headers={**csrf_headers(db_console), **HTMX},
                                follow_redirects=False)
    assert anonymous.status_code == 401 and anonymous.headers["HX-Redirect"] == "/admin/login"


def test_without_htmx_the_panel_is_a_page_that_carries_the_candidate(db_console: TestClient[Any]) -> None:
    _traffic(db_console)
    candidate = _short_prompts_to_large()
    page = db_console.post(REPLAY, data={"yaml": candidate}, headers=csrf_headers(db_console))
    assert page.status_code == 200 and "<html" in page.text
    assert "<h1>What this change would do</h1>" in page.text
    hidden = re.search(r'<input type="hidden" name="yaml" value="([^"]*)">', page.text, re.DOTALL)
    assert hidden is not None and html.unescape(hidden.group(1)) == candidate
    assert _text(page.text, "replay-placement").startswith("4 of 10 requests change placement")


# --- a canary ----------------------------------------------------------------------------------------

#: The request ids of :func:`_traffic`'s entries that are replayed (in the last hour, with a tier), and of its four
#: pro requests for auto (the ones :func:`_short_prompts_to_large` moves).
REPLAYED = [f"req-{n}" for n in (0, 1, 2, 3, 4, 10, 11, 12, 13, 21)]
MOVED = [f"req-{n}" for n in (10, 11, 12, 13)]


def test_a_canary_of_the_candidate_decides_only_its_slice(db_console: TestClient[Any]) -> None:
    """``replay_as`` a share: the candidate decides the requests the gateway's hash puts in the slice (by the
    logged request id here), the serving policy the rest; the panel says how many and shows the slice alone."""
    _traffic(db_console)
    text = _replay(db_console, _short_prompts_to_large(), replay_as="50", replay_by="request")
    inside = [r for r in REPLAYED if rules.in_slice(0, 50, f"r:{r}")]
    moved = [r for r in MOVED if r in inside]
    assert 0 < len(inside) < len(REPLAYED) and moved, "pick another share: the slice must split the log"
    assert _text(text, "replay-canary").startswith("The candidate (")
    assert f"decided {len(inside)} of 10 requests" in _text(text, "replay-canary")
    assert "the slice of 50% by request of the 10 requests in the canary's scope (every request)" in _text(
        text, "replay-canary")
    assert _text(text, "replay-placement").startswith(f"{len(moved)} of 10 requests change placement")
    assert _cells(text, "replay-canary-slice-served") == ["served", str(len(inside)), str(len(inside)), "same"]
    assert '<option value="50" selected>a canary of 50%</option>' in text
    assert '<option value="request" selected>request</option>' in text
    assert 'value="running"' not in text  # no canary runs
    # every request: no canary paragraph, all four move
    whole = _replay(db_console, _short_prompts_to_large())
    assert 'id="replay-canary"' not in whole and _text(whole, "replay-placement").startswith("4 of 10")
    for bad in ({"replay_as": "33"}, {"replay_as": "running"}, {"replay_as": "10", "replay_by": "moon"}):
        refused = _replay(db_console, _short_prompts_to_large(), **bad)
        assert "Choose one of the offered ways to replay the candidate" in refused, bad


def test_the_running_canary_is_replayed_with_its_slice_and_id(db_console: TestClient[Any]) -> None:
    _traffic(db_console)
    with db.session_scope(_engine(db_console)) as session:
        row = canary_store.start(session, Rollout(percent=50, by="request"), author="test", origin="test",
                                 text=_short_prompts_to_large())
        canary_id, version = row.id, row.version
    assert canary_id is not None and version == 2
    offered = _replay(db_console, V1)
    assert '<option value="running">the running canary (v2 on 50% by request) instead</option>' in offered
    text = _replay(db_console, V1, replay_as="running")  # the posted candidate is not the one replayed
    inside = [r for r in REPLAYED if rules.in_slice(canary_id, 50, f"r:{r}")]
    canary = _text(text, "replay-canary")
    assert canary.startswith(f"The candidate (v2) decided {len(inside)} of 10 requests"), canary
    assert "Candidate (v2 canary (50% by request))" in text
    moved = [r for r in MOVED if r in inside]
    assert _text(text, "replay-placement").startswith(f"{len(moved)} of 10 requests change placement")


# --- end to end: a real gateway, its request log, the official SDK -----------------------------------

def test_the_panel_replays_what_clients_sent_through_a_real_gateway(engines: Engines, tmp_path: Path) -> None:
    """Requests through the SDK land in the request log; the console's replay of a candidate that allows the
    free tier one request a minute shows those requests and predicts the 429s."""
    gw = start_gateway(engines, f"sqlite:///{tmp_path / 'gw.db'}", tmp_path, "sqlite",
                       {"SWITCHYARD_REQUEST_LOG_FLUSH_INTERVAL_S": "0.2"})
    try:
        gw.keys = {"free": gw.new_key("e2e-free", "free"), "pro": gw.new_key("e2e-pro", "pro")}
        # free's first: small has two pools, and a refusal must not free one for a later request
        for key, model, count in (("free", "small", 3), ("pro", "large", 2)):
            for i in range(count):
                client(gw, key).chat.completions.create(
                    model=model, max_tokens=4, messages=[{"role": "user", "content": f"replay me {key} {i}"}])
        console = gw.console("operator")
        active = engines.policy_file.read_text()
        free = "{name: free, priority: sheddable, models: [auto, small]}"
        assert free in active, "the test policy's free tier changed: update this candidate"
        candidate = active.replace(free, "{name: free, priority: sheddable, models: [auto, small], "
                                         "limits: {requests_per_minute: 1}}")

        def panel() -> str | None:
            answer = console.post(REPLAY, data={"yaml": candidate, "replay_window": "15m"}, headers=HTMX)
            assert answer.status_code == 200, answer.text
            return answer.text if 'id="replay-requests">5<' in answer.text else None

        text = eventually(panel, timeout=15)
        assert text, "the five requests never reached the replay from the request log"
        assert _text(text, "replay-entries").startswith("5 (")
        assert _text(text, "replay-skipped") == "none"
        # one request a minute: of free's three, the second and third are refused
        assert _cells(text, "replay-refusals-free") == ["free", "sheddable", "3", "0", "2", "0", "0", "0", "0"]
        assert _cells(text, "replay-refusals-pro") == ["pro", "standard", "2", "0", "0", "0", "0", "0", "0"]
        assert _text(text, "replay-placement") == (
            "2 of 5 requests change placement: 2 change model, 2 change pool, 2 change region.")
        assert _cells(text, "replay-headline-served") == ["served", "5", "3", "\u22122"]
    finally:
        assert stop(gw.proc)
