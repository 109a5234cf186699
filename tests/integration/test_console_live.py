"""The console's live pages: the Overview's traffic figures and sparklines, and the Requests page with its
filters and per-request decision traces.

Against a real gateway process over simulated engines (SQLite and PostgreSQL) with requests sent by the
official SDK, and in-process (``console``) for the empty states and for what real traffic here cannot
easily produce (fallbacks, cache hits).
"""

from __future__ import annotations

import html
import re
import uuid
from typing import Any

import httpx
import openai
import pytest
from litestar.testing import TestClient

from switchyard.figures import DASH
from switchyard.gateway.activity import Activity
from tests.integration.conftest import Gateway, client, console_login, eventually, http_json

HX = {"HX-Request": "true"}
SECRET_PROMPT = "ostrich-vellum-42 say something"


def stat(page: str, element_id: str) -> str:
    """The text of the element with ``element_id`` (one without child elements)."""
    found = re.search(rf'id="{re.escape(element_id)}"[^>]*>([^<]*)<', page)
    assert found, f"#{element_id} is missing"
    return found.group(1).strip()


def row(page: str, element_id: str) -> str:
    """The ``<tr>`` with ``element_id``, markup and all."""
    found = re.search(rf'<tr id="{re.escape(element_id)}"[^>]*>.*?</tr>', page, re.S)
    assert found, f"row #{element_id} is missing"
    return found.group(0)


def row_ids(page: str) -> list[str]:
    """The request ids of the Requests table's rows, in order."""
    return re.findall(r'<tr id="req-([^"]+)"', page)



def no_secrets(gateway: Gateway, *pages: str) -> None:
    for page in pages:
        for key in gateway.keys.values():
            assert key not in page
        assert "Bearer" not in page and "ostrich-vellum" not in page


# --- a real gateway ------------------------------------------------------------------------------

def test_live_overview_and_requests_pages_over_real_traffic(gateway: Gateway) -> None:
    run = uuid.uuid4().hex[:8]
    sdk = client(gateway, "pro")
    ok = sdk.chat.completions.with_raw_response.create(
        model="small", messages=[{"role": "user", "content": SECRET_PROMPT}], max_tokens=6,
        extra_headers={"x-request-id": f"live-ok-{run}"})
    assert ok.parse().choices[0].message.content
    ok_id = ok.headers["x-request-id"]
    ok_pool = dict(p.split("=", 1) for p in ok.headers["x-switchyard-route"].split("; "))["pool"]
    streamed = sdk.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True})
    stream_id = streamed.headers["x-request-id"]  # the gateway's own id
    stream_pool = dict(p.split("=", 1) for p in streamed.headers["x-switchyard-route"].split("; "))["pool"]
    assert list(streamed.parse())[-1].usage is not None
    unknown_model = f"no-such-model-{run}"
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.chat.completions.create(model=unknown_model, messages=[{"role": "user", "content": "hi"}])
    missing_id = not_found.value.response.headers["x-request-id"]  # error answers name the request too
    assert len({ok_id, stream_id, missing_id}) == 3

    console = gateway.console("viewer")

    # The overview's live partial: totals, per-pool rows and sparklines.
    partial = console.get("/admin/", headers=HX)
    assert partial.status_code == 200 and partial.text.lstrip().startswith('<div id="engines"')
    live = partial.text
    assert 'id="live-stats"' in live and "<html" not in live
    assert float(stat(live, "stat-rps")) > 0
    for name in ("stat-ttft-p50", "stat-ttft-p99"):
        assert re.fullmatch(r"\d+(\.\d)? ms", stat(live, name)), stat(live, name)
    for name in ("stat-shed-rate", "stat-fallback-rate", "stat-error-rate"):
        assert re.fullmatch(r"\d+\.\d%", stat(live, name)), stat(live, name)
    assert stat(live, "stat-cache-hit-rate")  # a percentage, or a dash while no rule looked anything up
    assert int(stat(live, "stat-requests")) >= 3
    pool_row = row(live, f"pool-stats-{ok_pool}")
    assert re.search(r'<svg class="sparkline"[^>]*role="img"[^>]*aria-label="Requests per second[^"]*"', pool_row)
    assert re.search(r'<polyline points="[-\d., ]+"', pool_row)
    # TTFT is a stream's: the pool that streamed shows one (a non-streamed answer's first byte is all of it).
    assert re.search(r"\d+(\.\d)? ms", row(live, f"pool-stats-{stream_pool}")), "the pool's TTFT figures"
    assert "Median time to first byte" in row(live, f"pool-stats-{stream_pool}")
    refused_row = row(live, "pool-stats--")  # the 404 never reached a pool
    assert "no pool" in refused_row
    for pool in ("small-us", "small-eu", "large-us", "dead-us"):
        row(live, f"pool-stats-{pool}")  # every pool of the policy has a row, with traffic or not
    assert "<th>Running</th>" in live

    # The full overview page carries the same live part, polled by htmx, and the policy version.
    page = console.get("/admin/").text
    assert page.count('id="engines"') == 1 and 'hx-get="/admin/" hx-trigger="every 2s"' in page
    assert 'id="stat-rps"' in page and "Policy v1" in page

    # The Requests page lists them, newest first, with who, what and where.
    def listed() -> str | None:
        text = console.get("/admin/requests", params={"tenant": "pro-co"}).text
        return text if {ok_id, stream_id, missing_id} <= set(row_ids(text)) else None

    listing = eventually(listed)
    assert listing, "the three requests are listed"
    assert "this gateway process" in listing and "500" in listing
    ids = row_ids(listing)
    assert ids.index(missing_id) < ids.index(stream_id) < ids.index(ok_id)
    ok_row = row(listing, f"req-{ok_id}")
    assert f'href="/admin/requests/{ok_id}"' in ok_row and ">200<" in ok_row and ">ok<" in ok_row
    assert "pro-co" in ok_row and ok_pool in ok_row and "http://127.0.0.1:" in ok_row
    assert "small" in ok_row
    assert "auto → small" in html.unescape(row(listing, f"req-{stream_id}"))
    missing_row = row(listing, f"req-{missing_id}")
    assert ">404<" in missing_row and "refused" in missing_row and "model_not_found" in missing_row
    assert 'id="requests-filter"' in listing and '<label for="filter-status">' in listing

    # Filters: status and model.
    four = console.get("/admin/requests", params={"tenant": "pro-co", "status": "4xx"}).text
    assert missing_id in row_ids(four) and ok_id not in row_ids(four) and stream_id not in row_ids(four)
    assert '<option value="4xx" selected>' in four
    oks = console.get("/admin/requests", params={"tenant": "pro-co", "status": "ok"}).text
    assert {ok_id, stream_id} <= set(row_ids(oks)) and missing_id not in row_ids(oks)
    assert row_ids(console.get("/admin/requests", params={"model": unknown_model}).text) == [missing_id]
    assert row_ids(console.get("/admin/requests", params={"status": "429", "tenant": "pro-co"}).text) == []
    nothing = console.get("/admin/requests", params={"tenant": f"nobody-{run}"})
    assert nothing.status_code == 200 and "No recent requests match" in nothing.text
    polled = console.get("/admin/requests", params={"status": "4xx", "tenant": "pro-co"}, headers=HX)
    assert polled.status_code == 200 and polled.text.lstrip().startswith('<div id="requests-live"')
    assert "<html" not in polled.text and missing_id in polled.text

    # A bad status filter is a 400 with the reason shown, not a 500.
    bad = console.get("/admin/requests", params={"status": "teapot"})
    assert bad.status_code == 400 and 'role="alert"' in bad.text and "teapot" in bad.text
    assert 'id="requests"' not in bad.text and 'id="requests-filter"' in bad.text

    # One request whole: its fields, decision trace and what it moved on from.
    detail = console.get(f"/admin/requests/{ok_id}")
    assert detail.status_code == 200
    trace = re.search(r'<ol id="request-trace"[^>]*>(.*?)</ol>', detail.text, re.S)
    assert trace, "the decision trace is an ordered list"
    lines = [html.unescape(line) for line in re.findall(r"<li><code>(.*?)</code></li>", trace.group(1), re.S)]
    assert "model small requested directly" in lines
    assert any(line.startswith("class standard") for line in lines)
    assert lines[-1] == f"route: {ok.headers['x-switchyard-route']}"
    assert 'id="request-moved-on"' in detail.text and ok_pool in detail.text and "pro-co" in detail.text
    stream_detail = console.get(f"/admin/requests/{stream_id}").text
    assert "route auto: rule short matched" in html.unescape(stream_detail)
    picked = next(line for line in html.unescape(stream_detail).splitlines() if "endpoint http" in line)
    assert "of 1" in picked or "; runners-up: http" in picked, picked  # why the chosen endpoint won
    missing_detail = console.get(f"/admin/requests/{missing_id}").text
    assert "model_not_found" in missing_detail and unknown_model in missing_detail
    gone = console.get(f"/admin/requests/never-{run}")
    assert gone.status_code == 404 and 'role="alert"' in gone.text and f"never-{run}" in gone.text

    no_secrets(gateway, live, page, listing, four, oks, polled.text, bad.text, detail.text, stream_detail,
               missing_detail)


def test_a_request_refused_before_its_decision_says_why_in_its_trace(gateway: Gateway) -> None:
    """A 400 for a malformed body never reaches the decision; its record still says what was wrong."""
    answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=10,
                        headers={"Authorization": f"Bearer {gateway.keys['pro']}"},
                        json={"model": "small", "messages": "not a list"})
    assert answer.status_code == 400
    rid = answer.headers["x-request-id"]
    status, _, record = http_json("GET", f"{gateway.base_url}/admin/api/requests/{rid}")
    assert status == 200, record
    [line] = record["trace"]
    assert line.startswith("refused 400 (") and line.endswith("before the decision"), line


def test_the_live_pages_want_a_session(gateway: Gateway) -> None:
    for path in ("/admin/requests", "/admin/requests/anything"):
        answer = httpx.get(f"{gateway.base_url}{path}", follow_redirects=False)
        assert answer.status_code == 303 and answer.headers["location"].startswith("/admin/login?next=")


# --- in process ----------------------------------------------------------------------------------

def test_with_no_traffic_yet_the_pages_say_so(console: TestClient[Any]) -> None:
    page = console.get("/admin/")
    assert page.status_code == 200
    assert 'id="no-traffic"' in page.text and "No requests in the last 5 minutes" in page.text
    assert stat(page.text, "stat-rps") == "0" and stat(page.text, "stat-requests") == "0"
    assert stat(page.text, "stat-ttft-p50") == stat(page.text, "stat-ttft-p99") == DASH
    assert stat(page.text, "stat-shed-rate") == stat(page.text, "stat-cache-hit-rate") == DASH
    partial = console.get("/admin/", headers=HX)
    assert partial.status_code == 200 and partial.text.lstrip().startswith('<div id="engines"')
    assert 'id="live-stats"' in partial.text and 'class="idle"' in partial.text
    assert "pool-stats--" not in partial.text and "pool-stats-cache" not in partial.text

    listing = console.get("/admin/requests")
    assert listing.status_code == 200 and "No requests yet" in listing.text
    assert 'id="requests-live"' in listing.text and 'id="requests"' not in listing.text
    assert "this gateway process" in listing.text
    filtered = console.get("/admin/requests", params={"status": "5xx", "model": "x"})
    assert filtered.status_code == 200 and "No recent requests match these filters" in filtered.text
    for query in ({"status": "bogus"}, {"limit": "0"}, {"limit": "lots"}, {"limit": "501"}):
        bad = console.get("/admin/requests", params=query)
        assert bad.status_code == 400 and 'role="alert"' in bad.text, query
    missing = console.get("/admin/requests/req-unknown")
    assert missing.status_code == 404 and "Request not found" in missing.text and 'role="alert"' in missing.text
    for answer in (page, listing, missing):
        assert "script-src 'self'" in answer.headers["content-security-policy"]
        assert "style=" not in answer.text and "<style" not in answer.text


def test_viewers_can_read_the_live_pages(console: TestClient[Any]) -> None:
    console.cookies.clear()
    assert console_login(console, "viewer").status_code == 303
    assert console.get("/admin/requests").status_code == 200
    assert console.get("/admin/", headers=HX).status_code == 200


def _record(activity: Activity, rid: str, status: int, **fields: Any) -> None:
    record = activity.begin(rid, "chat")
    for name, value in fields.items():
        setattr(record, name, value)
    activity.finish(record, status)


def test_fallbacks_cache_hits_and_sheds_show(console: TestClient[Any]) -> None:
    activity: Activity = console.app.state.runtime.activity
    _record(activity, "moved-1", 200, tenant="acme", model="m", resolved_model="m", served_model="m",
            pool="p1", region="r1", endpoint="http://127.0.0.1:1", attempts=2, ttft_s=0.02,
            moved_on=["http://127.0.0.1:9 cannot connect"], trace=["model m requested directly", "a <b> & c"])
    _record(activity, "hit-1", 200, tenant="acme", model="m", pool="cache", cache="hit", cache_rule="faq",
            ttft_s=0.001)
    _record(activity, "miss-1", 200, tenant="acme", model="m", pool="p1", cache="miss", ttft_s=0.03)
    _record(activity, "shed-1", 503, tenant="acme", model="m", shed=True)

    _record(activity, "line-1", 200, tenant="acme", model="m", pool="p1", batch=True, ttft_s=3.0)

    live = console.get("/admin/", headers=HX).text
    assert stat(live, "stat-cache-hit-rate") == "50.0%" and "of 2 cacheable" in live  # the rate with its base
    assert stat(live, "stat-batch-lines") == "1" and stat(live, "stat-requests") == "4"  # counted apart
    assert stat(live, "stat-shed-rate") == "25.0%" and stat(live, "stat-fallback-rate") == "25.0%"
    assert "response cache" in row(live, "pool-stats-cache") and "p1" in row(live, "pool-stats-p1")
    assert "100.0%" in row(live, "pool-stats--")  # the shed request never reached a pool

    assert row_ids(console.get("/admin/requests").text) == ["line-1", "shed-1", "miss-1", "hit-1", "moved-1"]
    assert row_ids(console.get("/admin/requests", params={"lane": "batch"}).text) == ["line-1"]
    listing = console.get("/admin/requests", params={"lane": "interactive"}).text
    assert row_ids(listing) == ["shed-1", "miss-1", "hit-1", "moved-1"]
    assert console.get("/admin/requests", params={"lane": "bulk"}).status_code == 400
    assert "hit (faq)" in row(listing, "req-hit-1") and ">503<" in row(listing, "req-shed-1")
    assert row_ids(console.get("/admin/requests", params={"status": "shed"}).text) == ["shed-1"]
    assert row_ids(console.get("/admin/requests", params={"limit": "2", "lane": "interactive"}).text) == [
        "shed-1", "miss-1"]

    detail = console.get("/admin/requests/moved-1").text
    moved = re.search(r'<ul id="request-moved-on">(.*?)</ul>', detail, re.S)
    assert moved and "http://127.0.0.1:9 cannot connect" in moved.group(1)
    assert "<li><code>a &lt;b&gt; &amp; c</code></li>" in detail, "trace lines are escaped"
    shed = console.get("/admin/requests/shed-1").text
    assert 'id="request-trace-empty"' in shed
