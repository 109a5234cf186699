"""The admin policy API (/admin/api/policy) on a real app, over SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient

from switchyard.app import create_app
from switchyard.policy import policy_sha256
from switchyard.settings import Settings
from tests.unit.policy.base import base, free_tokens_per_day, to_yaml

API = "/admin/api/policy"
TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
V1 = to_yaml(base())


V2 = free_tokens_per_day(5000)  # v1 says 10000


def _client(tmp_path: Path, database_url: str, source: str, token: str | None = TOKEN) -> TestClient[Any]:
    policy = tmp_path / "policies.yaml"
    policy.write_text(V1)
    settings = Settings(data_dir=tmp_path, database_url=database_url, policy_file=policy, policy_source=source,
                        admin_token=token)
    client = TestClient(app=create_app(settings))
    client.headers.update(AUTH)  # every admin API route wants the token
    return client


@pytest.fixture
def db_mode(tmp_path: Path, database_url: str) -> Iterator[TestClient[Any]]:
    """A gateway whose policy lives in the database (bootstrapped from the file as v1)."""
    with _client(tmp_path, database_url, "db") as client:
        yield client


def _line_of(text: str, needle: str) -> int:
    """The 1-based line of ``needle`` in ``text``."""
    return text[: text.index(needle)].count("\n") + 1


def _error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error  # type: ignore[no-any-return]


def test_reads(db_mode: TestClient[Any]) -> None:
    overview = db_mode.get(API).json()
    assert overview["policy_source"] == "db" and overview["text"] == V1
    assert overview["version"]["number"] == 1 and overview["version"]["sha256"] == policy_sha256(V1)
    assert overview["serving"] == {"version": "v1", "sha256": policy_sha256(V1)}
    assert (overview["file"], overview["matches_file"]) == (None, None)
    (listed,) = db_mode.get(f"{API}/versions").json()["versions"]
    assert listed == overview["version"]
    assert db_mode.get(f"{API}/versions/1").json() == {**listed, "text": V1}
    assert _error(db_mode.get(f"{API}/versions/7"), 404, "not_found")["message"] == "no policy version 7"
    assert db_mode.get(f"{API}/versions", params={"limit": 0}).status_code == 400
    (event,) = db_mode.get(f"{API}/audit").json()["events"]
    assert (event["action"], event["target"], event["origin"]) == ("policy.import", "policy:v1", "file")


def test_writes_are_disabled_without_an_admin_token(tmp_path: Path, database_url: str) -> None:
    with _client(tmp_path, database_url, "db", token=None) as client:
        for path, body in ((f"{API}/versions", {"yaml": V2}), (f"{API}/rollback", {"version": 1})):
            error = _error(client.post(path, json=body, headers=AUTH), 403, "admin_api_disabled")
            assert error["message"] == "the admin API is disabled: set SWITCHYARD_ADMIN_TOKEN"


def test_reads_and_writes_need_the_admin_token(db_mode: TestClient[Any]) -> None:
    del db_mode.headers["Authorization"]
    for path in (API, f"{API}/versions", f"{API}/audit", "/admin/api/endpoints"):
        _error(db_mode.get(path), 401, "invalid_admin_token")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        response = db_mode.post(f"{API}/versions", json={"yaml": V2}, headers=headers)
        _error(response, 401, "invalid_admin_token")
        assert response.headers["www-authenticate"] == "Bearer"
    assert len(db_mode.get(f"{API}/versions", headers=AUTH).json()["versions"]) == 1


def serving(client: TestClient[Any]) -> str:
    return str(client.get("/readyz").json()["checks"]["policy"]["version"])


def test_publish_diff_rollback_and_audit(db_mode: TestClient[Any]) -> None:

    published = db_mode.post(f"{API}/versions", json={"yaml": V2, "message": "tighter", "author": "alice"},
                             headers=AUTH)
    assert published.status_code == 201, published.text
    version = published.json()["version"]
    assert (version["number"], version["parent"], version["source"], version["author"], version["message"]) == (
        2, 1, "api", "alice", "tighter")
    assert serving(db_mode) == "v2"  # the process published through switched before answering
    again = db_mode.post(f"{API}/versions", json={"yaml": V2}, headers=AUTH)
    assert again.status_code == 200 and again.json()["created"] is False and again.json()["version"]["number"] == 2
    assert serving(db_mode) == "v2"

    diff = db_mode.get(f"{API}/diff", params={"from": "1", "to": "v2"}).json()
    assert (diff["from"], diff["to"]) == ("v1", "v2")
    assert diff["changes"] == ["tier free: limits.tokens_per_day 10000 → 5000"]
    assert diff["unified"].startswith("--- v1\n+++ v2\n")
    assert db_mode.get(f"{API}/diff", params={"from": "1"}).json()["to"] == "v2"  # default: the active version
    _error(db_mode.get(f"{API}/diff", params={"from": "latest"}), 400, "invalid_request")

    rolled = db_mode.post(f"{API}/rollback", json={"version": 1, "author": "bob"}, headers=AUTH)
    assert rolled.status_code == 201, rolled.text
    assert (rolled.json()["version"]["number"], rolled.json()["version"]["source"]) == (3, "rollback")
    assert db_mode.get(f"{API}/versions/3").json()["text"] == V1
    assert db_mode.post(f"{API}/rollback", json={"version": 1}, headers=AUTH).json()["created"] is False
    _error(db_mode.post(f"{API}/rollback", json={"version": 9}, headers=AUTH), 404, "not_found")
    assert serving(db_mode) == "v3"

    events = db_mode.get(f"{API}/audit").json()["events"]
    assert [(e["action"], e["target"], e["actor"]) for e in events] == [
        ("policy.rollback", "policy:v3", "bob"), ("policy.publish", "policy:v2", "alice"),
        ("policy.import", "policy:v1", "file:" + str(db_mode.app.state.runtime.settings.policy_file))]
    assert events[1]["origin"].startswith("api ")
    assert events[0]["detail"] == {"from": 2, "to": 3, "sha256": policy_sha256(V1), "source": "rollback",
                                   "message": "rollback to v1", "rollback_to": 1}


def test_an_invalid_document_is_422_with_its_issues_and_writes_nothing(db_mode: TestClient[Any]) -> None:
    doc = base()
    doc["pools"][0]["region"] = "us-esat"
    doc["tiers"][0]["priority"] = "nope"
    text = to_yaml(doc)
    response = db_mode.post(f"{API}/versions", json={"yaml": text}, headers=AUTH)
    error = _error(response, 422, "invalid_policy")
    assert "2 issues" in error["message"] and "nothing was written" in error["message"]
    issues = response.json()["issues"]
    assert [(i["path"], i["line"]) for i in issues] == [
        ("pools[small-us].region", _line_of(text, "region: us-esat")),
        ("tiers[free].priority", _line_of(text, "priority: nope"))]
    assert issues[0]["message"] == "unknown region 'us-esat'; did you mean 'us-east'?"
    _error(db_mode.post(f"{API}/versions", json={"yml": V2}, headers=AUTH), 400, "invalid_request")
    _error(db_mode.post(f"{API}/versions", content=b"{not json", headers=AUTH), 400, "invalid_request")
    assert len(db_mode.get(f"{API}/versions").json()["versions"]) == 1
    assert len(db_mode.get(f"{API}/audit").json()["events"]) == 1


def test_validate_writes_nothing(db_mode: TestClient[Any]) -> None:
    doc = base()
    doc["tests"][0]["expect"]["model"] = "large"
    text = to_yaml(doc)
    failing = db_mode.post(f"{API}/validate", content=text, headers={"Content-Type": "application/yaml"})
    assert failing.status_code == 200
    (issue,) = failing.json()["issues"]
    assert failing.json()["valid"] is False
    assert issue["path"] == "tests[hi is small].expect"
    assert issue["line"] == _line_of(text, "  expect:\n    model: large")
    assert issue["message"].startswith("policy test 'hi is small' failed")
    valid = db_mode.post(f"{API}/validate", json={"yaml": V2}).json()
    warnings = valid.pop("warnings")
    assert valid == {"valid": True, "issues": [], "sha256": policy_sha256(V2),
                     "changes_from_active": ["tier free: limits.tokens_per_day 10000 → 5000"]}
    # free may call auto but not large: the rule to large and the default are flagged, with their lines
    assert [(w["path"], w["line"]) for w in warnings] == [
        ("routes[auto].rules[hard].model", _line_of(V2, "model: large")),
        ("routes[auto].default", _line_of(V2, "default: large"))]
    _error(db_mode.post(f"{API}/validate", json={"text": V2}), 400, "invalid_request")
    assert len(db_mode.get(f"{API}/versions").json()["versions"]) == 1


def test_file_mode_is_read_only_and_shows_drift(tmp_path: Path, database_url: str) -> None:
    with _client(tmp_path, database_url, "file") as client:
        overview = client.get(API).json()
        assert overview["policy_source"] == "file"
        assert overview["file"]["sha256"] == policy_sha256(V1) and overview["matches_file"] is True
        for path, body in ((f"{API}/versions", {"yaml": V2}), (f"{API}/rollback", {"version": 1})):
            error = _error(client.post(path, json=body, headers=AUTH), 409, "policy_source_is_file")
            assert "policy_source is file" in error["message"]
        # An edit that is not (yet) a valid policy: the file drifts from the active version.
        (tmp_path / "policies.yaml").write_text(V1 + "bogus: 1\n")
        drifted = client.get(API).json()
        assert drifted["matches_file"] is False and drifted["version"]["number"] == 1
        assert len(client.get(f"{API}/versions").json()["versions"]) == 1
