"""Hot reload in file mode (GitOps): every way a file changes is picked up; no bad document ever serves."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Engines, Gateway, http_json, start_gateway, stop

#: A bound that only catches "never" (the file watch reacts in well under a second).
WITHIN_S = 10.0


def ready(gw: Gateway) -> dict[str, Any]:
    body: dict[str, Any] = http_json("GET", f"{gw.base_url}/readyz")[2]
    policy: dict[str, Any] = body["checks"]["policy"]
    return policy


def wait_for(check: Callable[[], Any], what: str) -> float:
    """Seconds until ``check()`` is truthy (fails the test after WITHIN_S)."""
    started = time.monotonic()
    while time.monotonic() - started < WITHIN_S:
        if check():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"not within {WITHIN_S}s: {what}")


def metric(gw: Gateway, name: str) -> float:
    text = http_json("GET", f"{gw.base_url}/metrics")[2]
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def route_version(gw: Gateway) -> str:
    status, headers, _ = http_json("POST", f"{gw.base_url}/v1/chat/completions",
                                   {"model": "small", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                                   {"Authorization": f"Bearer {gw.keys['pro']}"})
    assert status == 200
    match = re.search(r"policy=(v\d+)", headers["x-switchyard-route"])
    assert match is not None
    return match.group(1)


@pytest.fixture
def file_gateway(engines: Engines, tmp_path: Path, database_url: str) -> Iterator[tuple[Gateway, Path]]:
    """A gateway in file mode whose policy file lives in a ConfigMap-like folder of its own."""
    folder = tmp_path / "config"
    folder.mkdir()
    policy = folder / "policies.yaml"
    policy.write_text(engines.policy_file.read_text())
    gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), database_url, tmp_path, "x",
                       {"SWITCHYARD_POLICY_POLL_INTERVAL_S": "0.5"})
    try:
        gw.keys = {"pro": gw.new_key("pro-co", "pro")}
        yield gw, policy
    finally:
        assert stop(gw.proc)


def edited(text: str, n: int) -> str:
    """A valid edit of the test policy: the standard class's queue deadline set to ``n`` ms."""
    return text.replace("standard: {max_queue_ms: 1000}", f"standard: {{max_queue_ms: {n}}}")


def test_every_kind_of_file_change_is_picked_up(file_gateway: tuple[Gateway, Path]) -> None:
    gw, policy = file_gateway
    good = policy.read_text()
    assert ready(gw)["version"] == "v1" and route_version(gw) == "v1"

    policy.write_text(edited(good, 1001))  # rewritten in place
    wait_for(lambda: ready(gw)["version"] == "v2", "in-place rewrite")

    staged = policy.with_name(".policies.yaml.tmp")  # an editor's save: write aside, rename over
    staged.write_text(edited(good, 1002))
    os.replace(staged, policy)
    wait_for(lambda: ready(gw)["version"] == "v3", "rename over the file")

    # A Kubernetes ConfigMap mount: policies.yaml -> ..data/policies.yaml, ..data -> a timestamped
    # folder; an update writes a new folder and swaps the ..data link.
    folder = policy.parent
    for i, n in enumerate((1003, 1004)):
        stamp = folder / f"..2026_11_30_{i}"
        stamp.mkdir()
        (stamp / "policies.yaml").write_text(edited(good, n))
        link = folder / "..data_tmp"
        link.symlink_to(stamp.name)
        os.replace(link, folder / "..data")
        if i == 0:
            policy.unlink()
            policy.symlink_to("..data/policies.yaml")
        wait_for(lambda v=f"v{4 + i}": ready(gw)["version"] == v, "a ConfigMap-style symlink swap")  # type: ignore[misc]
    assert route_version(gw) == "v5"
    assert metric(gw, "switchyard_policy_active_version") == 5

    before = ready(gw)["activations"][-1]
    (folder / "..data" / "policies.yaml").touch()  # touched, not changed: nothing happens
    time.sleep(1.5)
    assert ready(gw)["activations"][-1] == before


BAD: dict[str, Callable[[str], str]] = {
    "syntax error": lambda t: t.replace("regions: [us-east, eu-west]", "regions: [us-east, eu-west"),
    "schema error": lambda t: t.replace("standard: {max_queue_ms: 1000}", "standard: {max_queue_ms: -5}"),
    "dangling reference": lambda t: t.replace("models: [auto, small]", "models: [auto, smal]"),
    "failing policy test": lambda t: t.replace("expect: {model: small}", "expect: {model: large}"),
    "empty file": lambda _t: "",
    "half-written file": lambda t: t[: len(t) // 2 + 7],
}
#: How each case's own rejection is recognised (distinct from the case before it, which may still show).
WHERE: dict[str, Callable[[str], bool]] = {
    "syntax error": lambda e: e.startswith("<document>: invalid YAML"),
    "schema error": lambda e: e.startswith("priorities.standard.max_queue_ms"),
    "dangling reference": lambda e: e.startswith("tiers[free].models"),
    "failing policy test": lambda e: e.startswith("tests[0].expect"),
    "empty file": lambda e: "the document must be a YAML mapping" in e,
    "half-written file": lambda e: "the document must be a YAML mapping" not in e,
}


def test_a_bad_document_never_serves_and_says_where_it_is_wrong(file_gateway: tuple[Gateway, Path]) -> None:
    gw, policy = file_gateway
    good = policy.read_text()
    failures = metric(gw, "switchyard_policy_reload_failures_total")
    for n, (case, spoil) in enumerate(BAD.items(), start=1):
        policy.write_text(spoil(good))

        def rejected(case: str = case) -> list[str]:
            # The watcher may also catch a write half-done; wait for this case's own verdict.
            state = ready(gw)
            errors: list[str] = state.get("rejected", {}).get("errors", [])
            return errors if errors and any(WHERE[case](e) for e in errors) else []

        wait_for(rejected, case)
        errors = rejected()
        state = ready(gw)
        assert state["version"] == "v1", case
        assert state["rejected"]["source"] == "file", case
        assert all(f"({policy}" in e for e in errors), (case, errors)
        if case not in ("empty file", "half-written file"):
            assert all(re.search(rf"\({re.escape(str(policy))}:\d+\)", e) for e in errors), (case, errors)
        assert route_version(gw) == "v1", case
        assert metric(gw, "switchyard_policy_reload_failures_total") >= failures + n
    # The console and the admin API say the same: the file differs from what runs, and why.
    console = gw.console("viewer")
    page = console.get("/admin/").text
    assert "differs from the running version" in page and 'id="version-1"' in page
    api = http_json("GET", f"{gw.base_url}/admin/api/policy")[2]
    assert api["matches_file"] is False and api["serving"]["version"] == "v1"
    assert api["rejected"]["source"] == "file" and api["rejected"]["issues"]
    policy.write_text(edited(good, 1500))
    wait_for(lambda: ready(gw)["version"] == "v2", "the repaired file")
    assert "rejected" not in ready(gw)
    page = console.get("/admin/").text
    assert "matches the running version" in page and 'id="version-2" class="active"' in page
    assert http_json("GET", f"{gw.base_url}/admin/api/policy")[2]["rejected"] is None
