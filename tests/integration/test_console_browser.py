"""The console in a real browser: Playwright driving Debian's Chromium against a live gateway over
simulated engines (policy in the database, so the console can publish).

Every page is screenshotted into ``test-artifacts/console/`` (``$SWITCHYARD_ARTIFACTS``) and checked
with axe-core: no serious or critical accessibility violations. A page that logs a browser console
error (a Content-Security-Policy violation, a failed htmx request) fails its test.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest
from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Browser, Page, Route, expect

from switchyard.store import db
from switchyard.whatif.logged import read_log
from tests import oidc_provider
from tests.conftest import SECRETS
from tests.integration.conftest import (
    CONSOLE_PASSWORD,
    CONSOLE_USERS,
    Engines,
    Gateway,
    eventually,
    start_gateway,
    stop,
)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("SWITCHYARD_ARTIFACTS", REPO / "test-artifacts")) / "console"
#: The questions the browser asked (confirmations), and whether the ``page`` fixture's tab accepts them.
DIALOGS: list[str] = []
ACCEPT = [True]
SSO_CLIENT = "switchyard-console"
SSO_SECRET = "browser-idp-secret-41c9"
SECRETS.add(SSO_SECRET)
#: axe-core impacts that fail a page.
SERIOUS = {"serious", "critical"}


@pytest.fixture(scope="module")
def idp() -> Iterator[str]:
    """The organisation's identity provider (OpenID Connect) the console also signs in through."""
    with oidc_provider.running(SSO_CLIENT, SSO_SECRET) as issuer:
        yield issuer


@pytest.fixture(scope="module")
def live(engines: Engines, idp: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway whose policy lives in the database (the console publishes), with console users and keys, and
    sign-in through ``idp`` beside them."""
    tmp = tmp_path_factory.mktemp("gw-browser")
    gw = start_gateway(engines, f"sqlite:///{tmp / 'gw.db'}", tmp, "sqlite",
                       {"SWITCHYARD_POLICY_SOURCE": "db", "SWITCHYARD_KEY_CACHE_TTL_S": "0",
                        "SWITCHYARD_CONSOLE_OIDC_ISSUER": idp, "SWITCHYARD_CONSOLE_OIDC_CLIENT_ID": SSO_CLIENT,
                        "SWITCHYARD_CONSOLE_OIDC_CLIENT_SECRET": SSO_SECRET,
                        "SWITCHYARD_CONSOLE_OIDC_LABEL": "Acme SSO",
                        "SWITCHYARD_CONSOLE_OIDC_ROLES": json.dumps({"gw-operators": "operator"})})
    try:
        gw.keys = {"free": gw.new_key("free-co", "free"), "pro": gw.new_key("pro-co", "pro")}
        for role, name in CONSOLE_USERS.items():
            gw.cli("admin", "create-user", name, "--role", role, "--password-stdin", input_text=CONSOLE_PASSWORD)
        yield gw
    finally:
        assert stop(gw.proc)


def log_in(page: Page, role: str = "admin") -> None:
    page.goto("/admin/login")
    page.get_by_label("Username").fill(CONSOLE_USERS[role])
    page.get_by_label("Password").fill(CONSOLE_PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#whoami")).to_contain_text(CONSOLE_USERS[role])


@pytest.fixture
def page(browser: Browser, live: Gateway) -> Iterator[Page]:
    """A fresh browser context on the live gateway, logged in as the admin; fails on browser console errors."""
    context = browser.new_context(base_url=live.base_url, viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    tab = context.new_page()
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda e: errors.append(str(e)))
    DIALOGS.clear()  # publish, roll back, revoke and purge ask first: accepted unless a test says otherwise
    tab.on("dialog", lambda d: (DIALOGS.append(d.message), d.accept() if ACCEPT[0] else d.dismiss()))
    try:
        log_in(tab)
        yield tab
        assert not errors, f"the browser logged errors: {errors}"
    finally:
        context.close()


def check_page(page: Page, name: str) -> None:
    """Screenshot the page into the artifacts and fail on serious accessibility violations."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True, caret="initial")  # "hide" injects a style
    results = Axe().run(page)
    serious = [v for v in results.response["violations"] if v["impact"] in SERIOUS]
    assert not serious, f"{name}: " + results.generate_report()


def test_login_form_in_the_browser(browser: Browser, live: Gateway) -> None:
    context = browser.new_context(base_url=live.base_url)
    try:
        tab = context.new_page()
        tab.goto("/admin/requests")
        expect(tab).to_have_url(re.compile(r"/admin/login\?next=/admin/requests$"))
        check_page(tab, "00-login")
        tab.get_by_label("Username").fill(CONSOLE_USERS["viewer"])
        tab.get_by_label("Password").fill("wrong password!")
        tab.get_by_role("button", name="Log in").click()
        expect(tab.locator("#login-error")).to_contain_text("Wrong username or password")
        tab.get_by_label("Password").fill(CONSOLE_PASSWORD)
        tab.get_by_role("button", name="Log in").click()
        expect(tab).to_have_url(re.compile(r"/admin/requests$"))  # back where it was going
        cookie = next(c for c in context.cookies() if c["name"] == "switchyard_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Lax"
    finally:
        context.close()


@pytest.mark.parametrize("width", [1440, 390])
def test_sign_in_through_the_identity_provider(browser: Browser, live: Gateway, width: int) -> None:
    context = browser.new_context(base_url=live.base_url, viewport={"width": width, "height": 900})
    try:
        tab = context.new_page()
        tab.goto("/admin/usage")
        expect(tab).to_have_url(re.compile(r"/admin/login\?next=/admin/usage$"))
        check_page(tab, f"01-login-sso-{width}")
        tab.get_by_role("link", name="Sign in with Acme SSO").click()
        expect(tab.get_by_role("heading", name="Test identity provider")).to_be_visible()  # the provider's page
        tab.get_by_label("Username").fill(f"sso-{width}")
        tab.get_by_label("Groups").fill("staff, gw-operators")
        tab.get_by_role("button", name="Sign in").click()
        expect(tab).to_have_url(re.compile(r"/admin/usage$"))  # back where it was going, signed in
        expect(tab.locator("#whoami")).to_contain_text(f"sso-{width}")
        expect(tab.locator("#whoami")).to_contain_text("operator")
        check_page(tab, f"02-signed-in-sso-{width}")
        assert not any(c["name"] == "switchyard_oidc" for c in context.cookies())  # the attempt is spent
        # a provider that says no: back on the login page, saying why, with no session
        context.clear_cookies()
        tab.goto("/admin/login")
        tab.get_by_role("link", name="Sign in with Acme SSO").click()
        tab.get_by_role("button", name="Cancel").click()
        expect(tab.locator("#login-error")).to_contain_text("access_denied")
        assert not any(c["name"] == "switchyard_session" for c in context.cookies())
    finally:
        context.close()


def _sdk(live: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def _ask(live: Gateway, key: str) -> int:
    """One small request with ``key``; its HTTP status."""
    try:
        _sdk(live, key).chat.completions.create(model="small", max_tokens=2,
                                                messages=[{"role": "user", "content": "hi"}])
    except openai.APIStatusError as error:
        return error.status_code
    return 200


def test_edit_a_tier_limit_review_the_diff_publish_and_the_gateway_enforces_it(page: Page, live: Gateway) -> None:
    assert [_ask(live, live.keys["free"]) for _ in range(3)] == [200, 200, 200]  # no request limit yet
    page.goto("/admin/policy")
    check_page(page, "10-policy")
    form = page.locator("#tier-limits-form")
    with page.expect_response(re.compile(r"/admin/policy/forms/tier-limits")):
        form.get_by_label("Tier").select_option("free")  # htmx reloads the form with that tier's limits
    form.get_by_label("requests per minute").fill("2")
    form.get_by_role("button", name="Review the change").click()
    expect(page.locator("#validation-status")).to_contain_text("valid", ignore_case=True)
    expect(page.locator("#diff")).to_contain_text("requests_per_minute")
    check_page(page, "11-policy-review")
    page.locator("#publish-message").fill("free tier: 2 requests a minute")
    page.locator("#publish").click()
    expect(page).to_have_url(re.compile(r"/admin/policy\?published=2$"))
    expect(page.locator("#history")).to_contain_text("free tier: 2 requests a minute")
    # Every replica reloads the new version; this one at once. Two requests a minute for free keys:
    deadline = time.monotonic() + 10
    statuses = [_ask(live, live.keys["free"]) for _ in range(3)]
    while 429 not in statuses and time.monotonic() < deadline:
        time.sleep(0.3)
        statuses.append(_ask(live, live.keys["free"]))
    assert 429 in statuses, statuses
    assert _ask(live, live.keys["pro"]) == 200  # other tiers untouched


def test_a_broken_yaml_edit_shows_its_line_and_cannot_be_published(page: Page, live: Gateway) -> None:
    page.goto("/admin/policy/edit")
    editor = page.locator("#policy-editor")
    text = editor.input_value()
    lines = text.splitlines()
    broken_at = next(i for i, line in enumerate(lines) if line.startswith("tiers:")) + 2
    lines.insert(broken_at - 1, "  - {name: oops, priority: nowhere, models: [small]}")
    editor.fill("\n".join(lines) + "\n")
    editor.press("End")  # a keyup: validation as you type
    expect(page.locator("#validation")).to_contain_text(f"line {broken_at}")
    expect(page.locator("#validation")).to_contain_text("nowhere")
    expect(page.locator("#publish")).to_be_disabled()
    check_page(page, "12-policy-broken")
    before = page.request.get("/admin/policy").text()
    # The server refuses it too, whatever the page lets through.
    answer = page.request.post("/admin/policy/publish", form={"yaml": editor.input_value(), "message": "x"},
                               headers={"x-csrftoken": next(c["value"] for c in page.context.cookies()
                                                            if c["name"] == "switchyard_csrf")})
    assert answer.status == 422
    assert page.request.get("/admin/policy").text().count("badge\">active") == before.count("badge\">active")


def test_rollback_from_the_history(page: Page, live: Gateway) -> None:
    page.goto("/admin/policy")
    rows = page.locator("#history tbody tr")
    first = page.locator("#rollback-1")
    if first.count() == 0:  # nothing published yet in this module: publish one first
        page.goto("/admin/policy/edit")
        editor = page.locator("#policy-editor")
        editor.fill(editor.input_value() + "# a comment-only change\n")
        page.locator("#publish-message").fill("a comment")
        page.locator("#publish").click()
        page.goto("/admin/policy")
    count = rows.count()
    page.locator("#rollback-message-1").fill("back to the first version")
    page.get_by_role("button", name="Roll back to v1").click()
    expect(page.locator("#history tbody tr")).to_have_count(count + 1)
    expect(page.locator("#history")).to_contain_text("back to the first version")
    expect(page.locator("#policy-version")).to_contain_text(f"v{count + 1}")


def test_create_a_tenant_and_a_key_use_it_then_revoke_it(page: Page, live: Gateway) -> None:
    page.goto("/admin/tenants")
    check_page(page, "20-tenants")
    form = page.locator("#create-tenant-form")
    form.get_by_label("Name").fill("browser-co")
    form.get_by_label("Tier").select_option("pro")
    form.get_by_role("button", name="Create tenant").click()
    expect(page).to_have_url(re.compile(r"/admin/tenants/browser-co$"))
    page.locator("#create-key-form").get_by_label("Name (optional)").fill("from the browser")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator("#new-key-secret").inner_text().strip()
    assert secret.startswith("sk-sy-")
    page.get_by_role("button", name="Copy").click()  # to the clipboard, or selected where there is none
    expect(page.locator("#new-key-secret-copied")).to_have_text(re.compile(r"^(Copied\.|Selected: .*)$"))
    check_page(page, "21-tenant-new-key")
    assert _ask(live, secret) == 200
    keys = page.locator("#keys button", has_text="Revoke").count()
    page.reload()  # the secret page is a GET after a redirect: a reload neither shows it again nor makes a key
    assert secret not in page.content()  # shown once
    expect(page.locator("#keys button", has_text="Revoke")).to_have_count(keys)
    ACCEPT[0] = False  # "Revoke key …?" answered No: nothing is sent, the key still works
    try:
        page.locator("#keys button", has_text="Revoke").first.click()
        assert DIALOGS and DIALOGS[-1].startswith("Revoke key sk-sy-")
        expect(page.locator("#keys button", has_text="Revoke")).to_have_count(keys)
        assert _ask(live, secret) == 200
    finally:
        ACCEPT[0] = True
    page.locator("#keys button", has_text="Revoke").first.click()
    expect(page.locator("#form-note")).to_contain_text("revoked")
    expect(page.locator("#keys")).to_contain_text("revoked", ignore_case=True)
    assert _ask(live, secret) == 401  # the key cache TTL is 0 here: at the next request


def test_dry_run_shows_every_stage_without_sending(page: Page, live: Gateway) -> None:
    before = _served(live)
    page.goto("/admin/dry-run")
    page.locator("#dry-run-tenant").select_option("pro-co")
    page.locator("#dry-run-model").select_option("auto")
    page.locator("#dry-run-prompt").fill("hi there")
    page.get_by_role("button", name="Dry-run").click()
    expect(page.locator("#dry-run-decided-model")).to_contain_text("small")
    expect(page.locator("#dry-run-trace li").first).to_be_visible()
    assert page.locator("#dry-run-trace li").count() >= 3
    check_page(page, "30-dry-run")
    assert _served(live) == before  # nothing went to an engine


def _served(live: Gateway) -> float:
    """Requests the gateway has finished, from its own metrics."""
    with httpx.Client(base_url=live.base_url) as c:
        text = c.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("switchyard_requests_total{"))


def test_the_overview_updates_while_traffic_flows(page: Page, live: Gateway) -> None:
    page.goto("/admin/")
    requests_before = page.locator("#stat-requests").inner_text()
    stop_traffic = threading.Event()

    def traffic() -> None:
        while not stop_traffic.is_set():
            _ask(live, live.keys["pro"])
            time.sleep(0.05)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        # No reload: the htmx poll (every 2 s) brings new figures and a sparkline.
        expect(page.locator("#stat-requests")).not_to_have_text(requests_before, timeout=15_000)
        expect(page.locator("#live-stats svg.sparkline polyline").first).to_be_attached()
        check_page(page, "01-overview-live")
    finally:
        stop_traffic.set()
        sender.join(timeout=10)


def test_every_page_renders_accessibly_for_a_viewer(browser: Browser, live: Gateway) -> None:
    """Screenshots of every page (as a viewer: no write forms) and the detail pages; axe on each."""
    _ask(live, live.keys["pro"])
    context = browser.new_context(base_url=live.base_url, viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    tab = context.new_page()
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        log_in(tab, "viewer")
        for name, path in (("02-overview", "/admin/"), ("13-policy-viewer", "/admin/policy"),
                           ("22-tenant", "/admin/tenants/pro-co"), ("23-usage", "/admin/usage"),
                           ("40-requests", "/admin/requests"), ("45-batches", "/admin/batches"),
                           ("50-cache", "/admin/cache"),
                           ("60-audit", "/admin/audit")):
            tab.goto(path)
            assert tab.locator("h1, h2").count() > 0, path
            check_page(tab, name)
            # At 1440 px the tables fit the page: none hides its columns behind a sideways scroll.
            assert tab.evaluate(FITS), f"{path}: something is wider than the page at 1440 px"
            wide = tab.evaluate("[...document.querySelectorAll('main table')].filter("
                                "t => t.scrollWidth > t.parentElement.clientWidth + 1).map(t => [t.id, t.scrollWidth, "
                                "t.parentElement.clientWidth, [...t.querySelectorAll('thead th')].map("
                                "h => h.textContent.trim() + ':' + Math.round(h.getBoundingClientRect().width))])")
            assert not wide, f"{path}: a table scrolls: {wide}"
        assert tab.locator("#purge-form").count() == 0  # a viewer cannot purge, so no form
        tab.goto("/admin/requests")
        tab.locator("#requests tbody tr a").first.click()
        expect(tab.locator("#request-trace li").first).to_be_visible()
        check_page(tab, "41-request-detail")
        tab.goto("/admin/policy/edit")
        expect(tab.locator("#publish")).to_have_count(0)  # viewers review, never publish
        assert not errors, errors
    finally:
        context.close()


#: Whether the page needs no sideways scroll (its content is no wider than the window).
FITS = "document.documentElement.scrollWidth <= window.innerWidth"
PHONE = {"width": 390, "height": 844}


def test_every_page_fits_a_phone_and_the_menu_folds(browser: Browser, live: Gateway) -> None:
    """At 390 px no page scrolls sideways (wide tables scroll inside themselves), the navigation folds behind
    a Menu button, and Log out stays in reach on every page."""
    _ask(live, live.keys["pro"])
    context = browser.new_context(base_url=live.base_url, viewport=PHONE, is_mobile=True, has_touch=True)
    errors: list[str] = []
    tab = context.new_page()
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        log_in(tab)
        tab.goto("/admin/requests")
        first = tab.locator("#requests tbody tr a").first.get_attribute("href")
        pages = [("/admin/", "m02-overview"), ("/admin/policy", "m13-policy"), ("/admin/policy/edit", "m14-editor"),
                 ("/admin/tenants", "m20-tenants"), ("/admin/tenants/pro-co", "m22-tenant"),
                 ("/admin/usage", "m23-usage"), ("/admin/requests", "m40-requests"), (first, "m41-request"),
                 ("/admin/batches", "m45-batches"), ("/admin/dry-run", "m30-dry-run"), ("/admin/cache", "m50-cache"),
                 ("/admin/audit", "m60-audit")]
        for path, name in pages:
            assert path
            tab.goto(path)
            expect(tab.get_by_role("button", name="Log out")).to_be_visible()
            expect(tab.locator("#console-nav")).to_be_hidden()
            assert tab.evaluate(FITS), f"{path} scrolls sideways at 390 px"
            check_page(tab, name)
        tab.get_by_role("button", name="Menu").click()
        expect(tab.locator("#nav-toggle")).to_have_attribute("aria-expanded", "true")
        expect(tab.get_by_role("link", name="Tenants & keys")).to_be_visible()
        assert tab.evaluate(FITS)
        check_page(tab, "m03-menu-open")
        tab.get_by_role("link", name="Tenants & keys").click()
        expect(tab).to_have_url(re.compile(r"/admin/tenants$"))
        expect(tab.locator("#console-nav")).to_be_hidden()  # a new page starts folded
        tab.get_by_role("button", name="Log out").click()
        expect(tab).to_have_url(re.compile(r"/admin/login$"))
        assert not errors, errors
    finally:
        context.close()


def test_the_console_works_from_the_keyboard(browser: Browser, live: Gateway) -> None:
    """Log in and reach a page with the keyboard alone: focus order follows the form, Enter submits."""
    context = browser.new_context(base_url=live.base_url)
    try:
        tab = context.new_page()
        tab.goto("/admin/login")
        expect(tab.get_by_label("Username")).to_be_focused()  # autofocus
        tab.keyboard.type(CONSOLE_USERS["operator"])
        tab.keyboard.press("Tab")
        expect(tab.get_by_label("Password")).to_be_focused()
        tab.keyboard.type(CONSOLE_PASSWORD)
        tab.keyboard.press("Enter")
        expect(tab.locator("#whoami")).to_contain_text(CONSOLE_USERS["operator"])
        tab.keyboard.press("Tab")  # the first stop is the skip link, then the navigation
        expect(tab.locator("a.skip")).to_be_focused()
        for _ in range(3):
            tab.keyboard.press("Tab")
        expect(tab.get_by_role("link", name="Policy")).to_be_focused()
        tab.keyboard.press("Enter")
        expect(tab).to_have_url(re.compile(r"/admin/policy$"))
    finally:
        context.close()


def _logged_requests(live: Gateway) -> int:
    engine = db.create_db_engine(live.env["SWITCHYARD_DATABASE_URL"])
    try:
        with db.session_scope(engine) as session:
            return len(read_log(session, window=timedelta(hours=1)))
    finally:
        engine.dispose()


def test_the_review_shows_what_the_change_would_do_then_publish(page: Page, live: Gateway) -> None:
    """A candidate from the editor: the review loads the replay of the request log by itself (htmx, after the
    page), above the publish button; re-validating the same text does not replay it again, a new window does."""
    assert _ask(live, live.keys["pro"]) == 200
    assert eventually(lambda: _logged_requests(live) > 0, timeout=10), "the request never reached the request log"
    replays: list[str] = []
    page.on("request", lambda r: replays.append(r.url) if r.url.endswith("/admin/policy/replay") else None)
    page.goto("/admin/policy/edit")
    editor = page.locator("#policy-editor")
    lines = editor.input_value().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("tiers:")) + 1
    lines.insert(at, "  - {name: trial, priority: sheddable, models: [small]}")  # no logged request is in it
    editor.fill("\n".join(lines) + "\n")
    page.locator("#publish-message").fill("a trial tier")
    held: list[Route] = []  # the replay's answer is held back a moment: publishing waits for it
    page.route(re.compile(r"/admin/policy/replay$"), lambda route: held.append(route))
    page.locator("#validate").click()  # the whole review page
    expect(page.locator("#validation-status")).to_contain_text("Valid")
    expect(page.locator("#replay-heading")).to_have_text("What this change would do")
    expect(page.locator("#publish")).to_be_disabled()
    expect(page.locator("#publish-waiting")).to_have_text("Publishing opens when the replay below has finished.")
    for _ in range(100):  # the panel asks for its replay once the page has loaded
        if held:
            break
        page.wait_for_timeout(100)
    assert held, "the replay was never asked for"
    expect(page.locator("#publish")).to_be_disabled()  # still: its answer has not come
    for route in held:
        route.continue_()
    page.unroute(re.compile(r"/admin/policy/replay$"))
    expect(page.locator("#replay-headline")).to_be_visible(timeout=30_000)
    expect(page.locator("#publish")).to_be_enabled()
    # a new tier moves none of the logged requests, and the panel says the log holds none of that tier
    expect(page.locator("#replay-placement")).to_contain_text(re.compile(r"^0 of [1-9]\d* requests change placement"))
    expect(page.locator("#replay-unseen")).to_contain_text("reached tier trial, which this change touches")
    panel, publish = page.locator("#replay-headline").bounding_box(), page.locator("#publish").bounding_box()
    assert panel is not None and publish is not None and panel["y"] < publish["y"]  # seen before publishing
    page.wait_for_load_state("networkidle")
    assert len(replays) == 1, replays  # validating on load kept the panel of the same candidate
    check_page(page, "14-policy-replay")
    with page.expect_response(re.compile(r"/admin/policy/replay$")):
        page.locator("#replay-window").select_option("15m")
    expect(page.locator("#replay-summary")).to_contain_text("the last 15 minutes")
    expect(page.locator("#replay-window")).to_have_value("15m")
    # typing makes another candidate: validated as typed, and replayed again (over the default window)
    before = page.locator("section.replay").get_attribute("id")
    editor.press("Control+End")  # the end of the document
    editor.type("# trial: for the pilot customers\n")
    expect(page.locator("section.replay")).not_to_have_id(before or "", timeout=10_000)
    expect(page.locator("#replay-headline")).to_be_visible(timeout=30_000)
    expect(page.locator("#replay-window")).to_have_value("1h")
    assert len(replays) == 3, replays
    page.locator("#publish").click()
    expect(page).to_have_url(re.compile(r"/admin/policy\?published=\d+$"))
    expect(page.locator("#history")).to_contain_text("a trial tier")
