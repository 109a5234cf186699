"""Policy canaries in a real browser: Playwright driving Debian's Chromium against a live gateway over simulated
engines (policy in the database). Publish a candidate as a canary from the editor, watch the panel fill in by
itself (htmx polling) while traffic flows, then abort it.

Skips (or fails, with ``SWITCHYARD_REQUIRE_BROWSER``) exactly as ``test_console_browser`` does when there is no
Chromium. Screenshots go to the test's temporary folder; every page shown is checked with axe-core.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Browser, Dialog, Page, expect

from switchyard.store import canary as canary_store
from switchyard.store import db
from tests.integration.conftest import CONSOLE_PASSWORD, CONSOLE_USERS, Engines, Gateway, start_gateway, stop
from tests.integration.test_console_browser import SERIOUS, log_in


@pytest.fixture(scope="module")
def live(engines: Engines, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose policy lives in the database (the console publishes), with console users and a key."""
    tmp = tmp_path_factory.mktemp("gw-canary-browser")
    gw = start_gateway(engines, f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                       {"SWITCHYARD_POLICY_SOURCE": "db", "SWITCHYARD_KEY_CACHE_TTL_S": "0"})
    try:
        gw.keys = {"pro": gw.new_key("pro-co", "pro")}
        for role, name in CONSOLE_USERS.items():
            gw.cli("admin", "create-user", name, "--role", role, "--password-stdin", input_text=CONSOLE_PASSWORD)
        yield gw
    finally:
        assert stop(gw.proc)


@pytest.fixture
def dialogs() -> list[str]:
    """The confirmations the page asked for (each accepted)."""
    return []


@pytest.fixture
def page(browser: Browser, live: Gateway, dialogs: list[str]) -> Iterator[Page]:
    """A fresh browser context on the live gateway, logged in as the operator; fails on browser console errors."""
    context = browser.new_context(base_url=live.base_url, viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    tab = context.new_page()
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))

    def answer(dialog: Dialog) -> None:  # publish as canary, abort and promote ask first: accepted
        dialogs.append(dialog.message)
        dialog.accept()

    tab.on("dialog", answer)
    try:
        log_in(tab, "operator")
        yield tab
        assert not errors, f"the browser logged errors: {errors}"
    finally:
        context.close()


def check_page(page: Page, folder: Path, name: str) -> Path:
    """Screenshot the page into ``folder`` and fail on serious accessibility violations."""
    shot = folder / f"{name}.png"
    page.screenshot(path=str(shot), full_page=True, caret="initial")
    results = Axe().run(page)
    serious = [v for v in results.response["violations"] if v["impact"] in SERIOUS]
    assert not serious, f"{name}: " + results.generate_report()
    return shot


def _ask(live: Gateway) -> int:
    """One small request with the pro key; its HTTP status."""
    sdk = openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.keys["pro"], max_retries=0, timeout=30)
    try:
        sdk.chat.completions.create(model="small", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    except openai.APIStatusError as error:
        return error.status_code
    return 200


def _latest(live: Gateway) -> tuple[int | None, str, str]:
    engine = db.create_db_engine(live.env["SWITCHYARD_DATABASE_URL"])
    try:
        with db.session_scope(engine) as session:
            row = canary_store.latest(session)
            assert row is not None
            return row.id, row.status, row.reason
    finally:
        engine.dispose()


def test_publish_as_canary_watch_the_panel_fill_in_then_abort(page: Page, live: Gateway, dialogs: list[str],
                                                              tmp_path: Path) -> None:
    page.goto("/admin/policy/edit")
    editor = page.locator("#policy-editor")
    lines = editor.input_value().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("tiers:")) + 1
    lines.insert(at, "  - {name: trial, priority: sheddable, models: [small]}")
    editor.fill("\n".join(lines) + "\n")
    editor.press("End")  # validated as typed
    expect(page.locator("#diff-changes")).to_contain_text("trial")
    expect(page.locator("#validation-status")).to_contain_text("Valid")
    page.locator("#publish-message").fill("a trial tier, tried on half the requests first")
    options = page.locator("#canary-options")
    options.locator("summary").click()
    expect(page.locator("#canary-guards-field")).to_have_value(re.compile(r"^ttft_p99=1\.5x\nerror_rate=\+1%"))
    page.get_by_label("Steps", exact=True).fill("50:10m")
    page.get_by_label("Slice by").select_option("request")  # one key's requests fall on both sides
    page.get_by_label("Guards, one a line").fill("ttft_p99=3x\nerror_rate=+5%\nshed_rate=+5%")
    page.get_by_label("Min requests").fill("20")
    options.scroll_into_view_if_needed()
    check_page(page, tmp_path, "20-canary-form")
    page.get_by_role("button", name="Publish as canary").click()
    expect(page).to_have_url(re.compile(r"/admin/policy/canary\?started=\d+$"))
    assert dialogs and dialogs[-1].startswith("Start a canary of this candidate?"), dialogs
    expect(page.locator(".policy-note")).to_contain_text("started")
    expect(page.locator("#canary-status")).to_have_text("running")
    expect(page.locator("#canary-percent")).to_contain_text("50% of the scope's traffic, hashed by request")
    expect(page.locator("#canary-figures-none")).to_be_visible()

    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if "/admin/policy/canary?live=" in r.url else None)
    # Hashed by request, each side's share is a coin toss a request: of 60, one side had 18 in a CI run (a step needs
    # 20; the odds of that are 0.6% a run); of 100, fewer than 20 on either side has odds of 3 in 10 billion.
    statuses = [_ask(live) for _ in range(100)]
    assert statuses.count(200) == 100, statuses
    # the gateway flushes its counts every 2 s and the panel asks again every 2 s: both sides appear by themselves
    figures = page.locator("#canary-figures")
    expect(figures).to_be_visible(timeout=15_000)
    expect(figures).to_contain_text("slice (v2)")
    expect(figures).to_contain_text("rest (v1)")
    expect(page.locator("#canary-guards")).to_be_visible(timeout=15_000)  # both sides have 20 requests
    expect(page.locator("#canary-next")).to_contain_text("Holding: step 1 of 1 at 50%")
    assert polls, "the panel never polled"
    # typing a reason is not disturbed by the panel's refreshes (the buttons are outside its live part)
    page.get_by_label("Reason (kept in the audit log)").fill("enough for today")
    seen = len(polls)
    deadline = time.monotonic() + 10
    while len(polls) == seen and time.monotonic() < deadline:
        page.wait_for_timeout(200)
    assert len(polls) > seen
    expect(page.get_by_label("Reason (kept in the audit log)")).to_have_value("enough for today")
    expect(page.locator("#canary-guards")).not_to_contain_text("breached")
    check_page(page, tmp_path, "21-canary-panel")

    page.get_by_role("button", name=re.compile(r"^Abort canary \d+$")).click()
    assert dialogs[-1].startswith("Abort canary"), dialogs
    expect(page).to_have_url(re.compile(r"/admin/policy/canary\?aborted=\d+$"))
    expect(page.locator("#canary-status")).to_have_text("aborted")
    expect(page.locator("#canary-ended")).to_contain_text(re.compile(r"^Aborted at .* UTC: enough for today$"))
    expect(page.locator("#canary-abort")).to_have_count(0)
    expect(page.locator("#canary-promote")).to_have_count(0)
    expect(page.locator("#canary-history")).to_contain_text("aborted")
    check_page(page, tmp_path, "22-canary-aborted")
    assert _latest(live)[1:] == ("aborted", "enough for today")
    page.goto("/admin/policy")
    expect(page.locator("#canary-banner")).to_have_count(0)
    expect(page.locator("#policy-version")).to_contain_text("v1")  # the active version never changed
