"""The console's policy page (/admin/policy) on a real app, over SQLite and PostgreSQL: the document by
section, structured edits that make a candidate, validation as you type, publish, rollback, roles and
the read-only file mode."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from switchyard.policy import policy_sha256
from switchyard.store import db
from switchyard.store.audit import list_events
from switchyard.store.policy_versions import list_versions
from tests.integration.conftest import add_console_users, console_login, csrf_headers
from tests.integration.test_admin_policy_api import V1, V2, _client, _line_of
from tests.unit.policy.base import base, to_yaml

PAGE = "/admin/policy"
HTMX = {"HX-Request": "true"}
TIER_FREE = {"tier": "free", "tokens_per_minute": "1000", "requests_per_minute": "", "tokens_per_day": "5000",
             "spend_per_month": ""}


@pytest.fixture
def db_console(tmp_path: Path, database_url: str) -> Iterator[TestClient[Any]]:
    """A gateway whose policy lives in the database (v1 from the file), the console users, logged in as the
    admin. (The ``console`` fixture's gateway runs in the default file mode.)"""
    with _client(tmp_path, database_url, "db") as client:
        del client.headers["Authorization"]  # the console goes by its session, never the admin token
        add_console_users(client.app.state.runtime.engine)
        assert console_login(client, "admin").status_code == 303
        yield client


def _candidate(page: str) -> str:
    """The text of the editor (#policy-editor) on a page."""
    found = re.search(r'<textarea id="policy-editor"[^>]*>\n(.*?)</textarea>', page, re.DOTALL)
    assert found is not None, page
    return html.unescape(found.group(1))


def _publish_button(page: str) -> str:
    found = re.search(r'<button id="publish"[^>]*>', page)
    assert found is not None, page
    return found.group(0)


def _versions(client: TestClient[Any]) -> list[Any]:
    with db.session_scope(client.app.state.runtime.engine) as session:
        return list_versions(session, 50)


def _events(client: TestClient[Any]) -> list[Any]:
    with db.session_scope(client.app.state.runtime.engine) as session:
        return list_events(session, 50, action="policy.")


def _post(client: TestClient[Any], path: str, data: dict[str, Any], **headers: str) -> Any:
    return client.post(path, data=data, headers={**csrf_headers(client), **headers}, follow_redirects=False)


def test_the_page_shows_the_document_by_section_its_tests_and_history(db_console: TestClient[Any]) -> None:
    page = db_console.get(PAGE)
    assert page.status_code == 200
    assert "default-src 'self'" in page.headers["content-security-policy"]
    text = page.text
    snapshot = db_console.app.state.runtime.policy.snapshot
    assert snapshot.sha256 in text and '<dd id="active-label">v1</dd>' in text
    for section in ("models", "pools", "routes", "tiers", "priorities", "cache-rules", "resilience", "policy-tests",
                    "history", "tier-limits-form", "fallback-form", "cache-rule-form"):
        assert f'id="{section}"' in text, section
    assert 'id="file-mode-banner"' not in text
    assert '<tr id="model-large">' in text and "<li>small</li>" in text  # large's fallback chain
    assert '<tr id="tier-free">' in text and '<td class="num">10,000 tokens</td>' in text
    assert '<tr id="priority-batch">' in text and "10m" in text  # the cache rule's ttl
    assert "1 of 1 policy tests pass" in text and "hi is small" in text
    assert '<tr id="version-1" class="active">' in text and 'id="rollback-1"' not in text  # active: no rollback
    # the forms are filled from the active version
    assert 'id="limit-tokens_per_day" name="tokens_per_day" type="number" min="1"' in text
    assert 'value="10000"' in text and 'id="fallback-step-1" name="fallback" value="small@eu-west"' in text
    assert 'id="cache-ttl" name="ttl" value="10m"' in text
    other = db_console.get(f"{PAGE}/forms/tier-limits", params={"tier": "pro"}, headers=HTMX)
    assert other.status_code == 200 and '<option value="pro" selected>' in other.text
    assert other.text.lstrip().startswith('<form id="tier-limits-form"')
    assert db_console.get(f"{PAGE}/forms/nope").status_code == 404


def test_a_tier_limit_form_makes_a_candidate_and_publishing_it_makes_a_version(db_console: TestClient[Any]) -> None:
    assert console_login(db_console, "operator").status_code == 303
    review = _post(db_console, f"{PAGE}/edit/tier-limits", TIER_FREE)
    assert review.status_code == 200, review.text
    candidate = _candidate(review.text)
    assert candidate == V2  # only the limit changed: layout, order and the rest of the text kept
    assert "tier free: limits.tokens_per_day 10000 → 5000" in review.text
    assert 'id="validation-status" class="ok">Valid' in review.text
    assert "disabled" not in _publish_button(review.text)
    assert 'id="publish-message" name="message" value="tier free: limits"' in review.text
    assert len(_versions(db_console)) == 1  # a form never publishes

    # a browser sends the textarea with CRLF line ends: the stored text is the document's own
    published = _post(db_console, f"{PAGE}/publish", {"yaml": candidate.replace("\n", "\r\n"), "message": "tighter"})
    assert published.status_code == 303, published.text
    assert published.headers["location"] == "/admin/policy?published=2"
    snapshot = db_console.app.state.runtime.policy.snapshot
    assert (snapshot.version, snapshot.sha256) == (2, policy_sha256(V2))
    latest = _versions(db_console)[0]
    assert (latest.number, latest.source, latest.author, latest.message, latest.active) == (
        2, "console", "console:otto", "tighter", True)
    event = _events(db_console)[0]
    assert (event.action, event.target, event.actor) == ("policy.publish", "policy:v2", "console:otto")
    assert event.origin.startswith("console ")
    page = db_console.get(published.headers["location"])
    assert "Published v2: it is now the active version." in page.text
    assert '<tr id="version-2" class="active">' in page.text
    # the same content again is no new version
    again = _post(db_console, f"{PAGE}/publish", {"yaml": V2, "message": ""})
    assert again.headers["location"] == "/admin/policy?unchanged=2" and len(_versions(db_console)) == 2


def test_the_fallback_and_cache_rule_forms_make_candidates(db_console: TestClient[Any]) -> None:
    review = _post(db_console, f"{PAGE}/edit/fallback", {"model": "large", "fallback": ["small@eu-west", "small", ""]})
    assert review.status_code == 200, review.text
    assert "model large: fallback [small] → [small@eu-west, small]" in review.text
    doc = base()
    doc["models"][1]["fallback"] = ["small@eu-west", "small"]
    assert _candidate(review.text) == to_yaml(doc)
    assert "Valid" in review.text

    rule = {"rule": "0", "mode": "exact", "ttl": "1h", "scope": "tenant", "min_similarity": "", "embedding_pool": "",
            "match_models": "small, large", "match_routes": "", "match_tiers": ""}
    review = _post(db_console, f"{PAGE}/edit/cache-rule", rule)
    assert review.status_code == 200, review.text
    doc = base()
    doc["cache"][0]["ttl"] = "1h"  # scope: tenant is the default, so it is not written
    doc["cache"][0]["match"]["models"] = ["small", "large"]
    assert _candidate(review.text) == to_yaml(doc)
    assert "cache[0].ttl 10m → 1h" in review.text and "disabled" not in _publish_button(review.text)

    # an edit can make the document invalid: the review says why, and it cannot be published
    review = _post(db_console, f"{PAGE}/edit/cache-rule", {**rule, "mode": "semantic"})
    assert review.status_code == 200
    assert "a semantic rule needs min_similarity" in review.text and "cache[0]" in review.text
    assert "disabled" in _publish_button(review.text)
    assert _post(db_console, f"{PAGE}/edit/fallback", {"model": "nope", "fallback": "small"}).status_code == 404
    assert len(_versions(db_console)) == 1


def test_a_broken_document_shows_its_errors_and_is_never_published(db_console: TestClient[Any]) -> None:
    editor = db_console.get(f"{PAGE}/edit")
    assert editor.status_code == 200 and _candidate(editor.text) == V1
    assert 'hx-post="/admin/policy/validate"' in editor.text and "keyup changed delay:500ms" in editor.text

    doc = base()
    doc["tiers"][0]["priority"] = "nope"
    broken = to_yaml(doc)
    line = _line_of(broken, "priority: nope")
    partial = _post(db_console, f"{PAGE}/validate", {"yaml": broken}, **HTMX)
    assert partial.status_code == 200
    assert "<html" not in partial.text and 'role="alert"' in partial.text
    assert f"line {line}: " in partial.text and "tiers[free].priority" in partial.text
    assert "disabled" in _publish_button(partial.text)

    not_yaml = V1 + "tiers: [unclosed\n"
    partial = _post(db_console, f"{PAGE}/validate", {"yaml": not_yaml}, **HTMX)
    assert "invalid YAML" in partial.text and re.search(r"line \d+: invalid YAML", partial.text)
    assert "No comparison: the candidate is not YAML yet." in partial.text

    valid = _post(db_console, f"{PAGE}/validate", {"yaml": V2}, **HTMX)
    assert "Valid" in valid.text and "tier free: limits.tokens_per_day 10000 → 5000" in valid.text
    assert "disabled" not in _publish_button(valid.text) and "1 of 1 policy tests pass" in valid.text
    warnings = valid.text[valid.text.index('id="validation-warnings"'):]  # valid, with what a tier never takes
    assert "2 warnings (the candidate can be published)" in warnings
    assert f"line {_line_of(V2, 'model: large')}: tier free may call route auto but never takes this rule" in warnings
    full = _post(db_console, f"{PAGE}/validate", {"yaml": broken, "message": "m"})  # without htmx: the whole editor
    assert full.status_code == 200 and "<html" in full.text and _candidate(full.text) == broken

    # the server never trusts the page: publishing it anyway is refused, and nothing changes
    for text in (broken, not_yaml):
        refused = _post(db_console, f"{PAGE}/publish", {"yaml": text, "message": "sneaky"})
        assert refused.status_code == 422, refused.text
        assert "Not published: the candidate has 1 issue; nothing was written." in refused.text
        assert _candidate(refused.text) == text
    assert db_console.app.state.runtime.policy.snapshot.version == 1
    assert len(_versions(db_console)) == 1 and len(_events(db_console)) == 1


def test_rollback_makes_an_old_version_active_again(db_console: TestClient[Any]) -> None:
    assert _post(db_console, f"{PAGE}/publish", {"yaml": V2, "message": "tighter"}).status_code == 303
    assert 'id="rollback-1"' in db_console.get(PAGE).text
    rolled = _post(db_console, f"{PAGE}/rollback", {"version": "1", "message": ""})
    assert rolled.status_code == 303 and rolled.headers["location"] == "/admin/policy?rolled_back=3"
    snapshot = db_console.app.state.runtime.policy.snapshot
    assert (snapshot.version, snapshot.sha256) == (3, policy_sha256(V1))
    latest = _versions(db_console)[0]
    assert (latest.source, latest.author, latest.message) == ("rollback", "console:ada", "rollback to v1")
    event = _events(db_console)[0]
    assert (event.action, event.target, event.detail["rollback_to"]) == ("policy.rollback", "policy:v3", 1)
    page = db_console.get(rolled.headers["location"]).text
    assert "Rolled back: v3 is now the active version." in page
    assert 'id="rollback-1"' in page and 'id="rollback-2"' in page and 'id="rollback-3"' not in page
    assert _post(db_console, f"{PAGE}/rollback", {"version": "1"}).headers["location"] == "/admin/policy?unchanged=3"
    missing = _post(db_console, f"{PAGE}/rollback", {"version": "9"})
    assert missing.status_code == 404 and "no policy version 9" in missing.text


def test_history_rows_link_to_each_version_its_diff_and_say_when_it_repeats_one(db_console: TestClient[Any]) -> None:
    assert _post(db_console, f"{PAGE}/publish", {"yaml": V2, "message": "tighter"}).status_code == 303
    assert _post(db_console, f"{PAGE}/rollback", {"version": "1"}).status_code == 303
    page = db_console.get(PAGE).text
    # Each section links to its edit (the structured form on the page, else the YAML editor).
    for link, form in (("edit-tiers", "tier-limits-form"), ("edit-models", "fallback-form"),
                       ("edit-cache-rules", "cache-rule-form")):
        assert f'id="{link}" href="#{form}"' in page and f'id="{form}"' in page
    assert page.count('class="section-edit"') == 7
    history = page[page.index('<table id="history"'):page.index("</table>", page.index('<table id="history"'))]
    assert 'href="/admin/policy/versions/3"' in history and "(same content as v1)" in history
    assert "diff from v2" in history and history.count("same content as") == 1
    v3 = db_console.get(f"{PAGE}/versions/3")
    assert v3.status_code == 200
    assert 'id="version-same-as"' in v3.text and "Same content as" in v3.text and "(a rollback)" in v3.text
    assert "Changes from v2" in v3.text and "tier free: limits.tokens_per_day 5000 → 10000" in v3.text
    v2 = db_console.get(f"{PAGE}/versions/2")
    assert "tier free: limits.tokens_per_day 10000 → 5000" in v2.text and 'id="version-same-as"' not in v2.text
    assert 'href="/admin/policy/versions/2?against=3"' in v2.text
    against = db_console.get(f"{PAGE}/versions/2", params={"against": "3"}).text
    assert "Changes from v3" in against and "10000 → 5000" in against
    assert "No earlier version to compare with." in db_console.get(f"{PAGE}/versions/1").text
    assert db_console.get(f"{PAGE}/versions/9").status_code == 404


def test_a_viewer_reads_and_validates_but_cannot_change_anything(db_console: TestClient[Any]) -> None:
    assert console_login(db_console, "viewer").status_code == 303
    page = db_console.get(PAGE)
    assert page.status_code == 200 and 'id="history"' in page.text
    assert 'id="tier-limits-form"' not in page.text and 'id="rollback-' not in page.text
    assert _post(db_console, f"{PAGE}/validate", {"yaml": V2}, **HTMX).status_code == 200
    editor = db_console.get(f"{PAGE}/edit")
    assert editor.status_code == 200 and 'id="publish"' not in editor.text
    for path, data in ((f"{PAGE}/publish", {"yaml": V2}), (f"{PAGE}/rollback", {"version": "1"}),
                       (f"{PAGE}/edit/tier-limits", TIER_FREE),
                       (f"{PAGE}/edit/fallback", {"model": "large", "fallback": "small"}),
                       (f"{PAGE}/edit/cache-rule", {"rule": "0", "ttl": "1h"})):
        answer = _post(db_console, path, data)
        assert answer.status_code == 403, (path, answer.status_code)
        assert "this needs the operator role" in answer.text
    assert db_console.get(f"{PAGE}/forms/fallback").status_code == 403
    assert len(_versions(db_console)) == 1


def test_file_mode_is_read_only_with_a_drift_banner(console: TestClient[Any], tmp_path: Path) -> None:
    """The ``console`` fixture's gateway runs in the default mode: the policy file is the truth."""
    assert console.app.state.runtime.settings.policy_source == "file"
    assert console_login(console, "operator").status_code == 303
    page = console.get(PAGE).text
    banner = page[page.index('id="file-mode-banner"'):]
    assert str(tmp_path / "policies.yaml") in banner and "The file matches the running version v1." in banner
    assert "SWITCHYARD_POLICY_SOURCE=db" in banner and "--policy-source file" in banner  # how to switch
    assert 'id="tier-limits-form"' not in page and 'id="rollback-' not in page and 'id="history"' in page
    assert 'class="section-edit"' not in page  # nothing to edit here
    editor = console.get(f"{PAGE}/edit").text
    assert 'id="file-mode-banner"' in editor and 'id="publish"' not in editor
    assert _post(console, f"{PAGE}/validate", {"yaml": V2}, **HTMX).status_code == 200  # drafts can be checked
    for path, data in ((f"{PAGE}/publish", {"yaml": V2}), (f"{PAGE}/rollback", {"version": "1"}),
                       (f"{PAGE}/edit/tier-limits", TIER_FREE)):
        answer = _post(console, path, data)
        assert answer.status_code == 409, (path, answer.status_code)
        assert "policy_source is file" in answer.text and "changes only through that file" in answer.text
    assert len(_versions(console)) == 1
    (tmp_path / "policies.yaml").write_text(V1 + "bogus: 1\n")
    assert "the file differs from the running version v1" in console.get(PAGE).text
