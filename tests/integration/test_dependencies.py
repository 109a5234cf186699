"""Switchyard's own dependencies going away, for real: gateway processes whose Redis and PostgreSQL
connections pass through a loopback forwarder that the test cuts (refusing new connections and
resetting the open ones) and restores on the same port.

- Redis, ``fail_open``: the limits are enforced by each gateway process on its own (200 until its
  own bucket is empty, then 429), counted in ``switchyard_dependency_failures_total``; once Redis
  answers again the replicas share their buckets again.
- Redis, ``fail_closed``: requests with limits get 503 ``limits_unavailable`` with ``Retry-After``;
  requests without limits never touch Redis and are served.
- PostgreSQL: the policy snapshot keeps serving; keys seen before keep working past their cache TTL
  (``fail_open``) or get 503 ``auth_unavailable`` once it expired (``fail_closed``); a key never seen
  gets 503; ``/readyz`` says 503 until the database answers; the usage ledger loses no request.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url, text

from switchyard.store import db
from switchyard.store.keys import generate_key
from tests.helpers import TcpForwarder
from tests.integration.conftest import Engines, Gateway, gateway_counter, http_json, start_gateway, stop
from tests.integration.test_admission import chat, limited_policy, reserved
from tests.unit.store.redis_support import REDIS_URL

#: A bound that only catches "never".
WITHIN_S = 15.0
DEPENDENCY_FAILURES = "switchyard_dependency_failures_total"


def with_dependencies(policy: Path, redis: str = "fail_open", database: str = "fail_open") -> str:
    """The text of ``policy`` with a ``resilience.dependencies`` section."""
    return policy.read_text() + f"resilience:\n  dependencies: {{redis: {redis}, database: {database}}}\n"


def write_policy(path: Path, content: str) -> None:
    """Replace ``path`` at once (the gateway never reads half a file)."""
    scratch = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
    scratch.write_text(content)
    os.replace(scratch, path)


def wait_for(check: Callable[[], Any], what: str) -> Any:
    """``check()``'s first truthy answer (fails the test after WITHIN_S)."""
    deadline = time.monotonic() + WITHIN_S
    while time.monotonic() < deadline:
        answer = check()
        if answer:
            return answer
        time.sleep(0.05)
    raise AssertionError(f"not within {WITHIN_S}s: {what}")


def failures(gw: Gateway, dependency: str, mode: str) -> float:
    return gateway_counter(gw, DEPENDENCY_FAILURES, dependency=dependency, mode=mode)


def remaining(headers: dict[str, str]) -> int:
    return int(headers["x-ratelimit-remaining-tokens"])


def readyz(gw: Gateway) -> tuple[int, dict[str, Any]]:
    status, _, body = http_json("GET", f"{gw.base_url}/readyz")
    return status, body


def policy_label(headers: dict[str, str]) -> str:
    match = re.search(r"policy=([^;]+)", headers["x-switchyard-route"])
    assert match is not None
    return match.group(1)


@pytest.fixture
def redis_link() -> Iterator[TcpForwarder]:
    """A forwarder to the test Redis server."""
    target = make_url(REDIS_URL)
    with TcpForwarder(target.port or 6379, target.host or "127.0.0.1") as link:
        yield link


def redis_env(link: TcpForwarder) -> dict[str, str]:
    """Gateway settings for Redis through ``link``, under a key prefix of the test's own."""
    url = make_url(REDIS_URL).set(host="127.0.0.1", port=link.port)
    return {"SWITCHYARD_REDIS_URL": url.render_as_string(hide_password=False),
            "SWITCHYARD_REDIS_KEY_PREFIX": f"test-{uuid.uuid4().hex[:8]}:"}


@pytest.mark.redis
def test_redis_fail_open_enforces_limits_per_replica_and_shares_them_again(
        engines: Engines, tmp_path: Path, redis_link: TcpForwarder) -> None:
    policy = limited_policy(engines, "{}")
    per_request = reserved(policy, 200)
    limit = 4 * per_request + per_request // 4  # four requests fit in a full bucket, not five
    policy.write_text(policy.read_text().replace("limits: {}}", f"limits: {{tokens_per_minute: {limit}}}}}", 1))
    policy.write_text(with_dependencies(policy, redis="fail_open"))
    files = Engines(policy, engines.ports, engines.dead_port)
    env = redis_env(redis_link)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    a = start_gateway(files, url, tmp_path / "a", "sqlite", env)
    b = start_gateway(files, url, tmp_path / "b", "sqlite", env)
    try:
        key = a.new_key("racer", "free")
        # Redis answers: one bucket for both replicas.
        status, headers_a, body = chat(a, key, 200)
        assert status == 200, body
        assert remaining(headers_a) == limit - per_request
        status, headers_b, _ = chat(b, key, 200)
        assert status == 200 and remaining(headers_b) < remaining(headers_a) - per_request // 2

        redis_link.cut()
        # Each replica now enforces the limit on a bucket of its own, starting full.
        statuses: list[int] = []
        while not statuses or statuses[-1] == 200:
            status, headers, body = chat(a, key, 200)
            statuses.append(status)
            if len(statuses) == 1:
                assert status == 200 and remaining(headers) == limit - per_request, body
            assert len(statuses) <= 6, statuses
        assert statuses[-1] == 429 and body["error"]["code"] == "rate_limit_exceeded", body
        assert int(headers["retry-after"]) >= 1
        assert statuses.count(200) >= 2
        assert failures(a, "redis", "fail_open") == len(statuses)
        assert failures(a, "redis", "fail_closed") == 0
        status, headers, _ = chat(b, key, 200)  # the other replica's own bucket is full
        assert status == 200 and remaining(headers) == limit - per_request
        assert failures(b, "redis", "fail_open") == 1

        redis_link.restore()

        def shared_again(gw: Gateway) -> tuple[int, dict[str, str]] | None:
            before = failures(gw, "redis", "fail_open")
            status, headers, _ = chat(gw, key, 200)
            return (status, headers) if failures(gw, "redis", "fail_open") == before else None

        # After its back-off, A reserves on Redis again, whose bucket has room (A's own had none).
        status, headers_a = wait_for(lambda: shared_again(a), "gateway a uses Redis again")
        assert status == 200
        status, headers_b = wait_for(lambda: shared_again(b), "gateway b uses Redis again")
        assert status in (200, 429) and remaining(headers_b) < remaining(headers_a)
    finally:
        redis_link.restore()
        assert stop(a.proc) and stop(b.proc)


@pytest.mark.redis
def test_redis_fail_closed_refuses_requests_with_limits(
        engines: Engines, tmp_path: Path, redis_link: TcpForwarder) -> None:
    policy = limited_policy(engines, "{tokens_per_minute: 100000}")
    policy.write_text(with_dependencies(policy, redis="fail_closed"))
    gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), f"sqlite:///{tmp_path / 'sy.db'}",
                       tmp_path, "sqlite", redis_env(redis_link))
    try:
        limited, unlimited = gw.new_key("limited-co", "free"), gw.new_key("unlimited-co", "pro")
        assert chat(gw, limited, 10)[0] == 200
        redis_link.cut()
        for _ in range(3):
            status, headers, body = chat(gw, limited, 10)
            assert status == 503, body
            assert body["error"]["code"] == "limits_unavailable" and body["error"]["type"] == "overloaded_error"
            assert int(headers["retry-after"]) >= 1
        assert failures(gw, "redis", "fail_closed") == 3 and failures(gw, "redis", "fail_open") == 0
        status, ready = readyz(gw)  # Redis is not part of readiness: the policy says what happens meanwhile
        assert status == 200 and ready["dependencies"]["limit_store"] == "unreachable"
        # A request without limits never asks Redis.
        assert chat(gw, unlimited, 10)[0] == 200
        assert failures(gw, "redis", "fail_closed") == 3
        redis_link.restore()
        wait_for(lambda: chat(gw, limited, 10)[0] == 200, "requests with limits are admitted again")
    finally:
        redis_link.restore()
        assert stop(gw.proc)


def _ledger_requests(database_url: str, tenant: str) -> int:
    engine = db.create_db_engine(database_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "SELECT COALESCE(SUM(u.requests), 0) FROM usage_daily u JOIN tenant t ON t.id = u.tenant_id "
                "WHERE t.name = :name"), {"name": tenant}).scalar_one())
    finally:
        engine.dispose()


def test_database_outage_keeps_the_policy_and_known_keys_serving(
        engines: Engines, tmp_path: Path, pg_database: Callable[[], str]) -> None:
    direct = pg_database()
    target = make_url(direct)
    with TcpForwarder(target.port or 5432, target.host or "127.0.0.1") as link:
        through = target.set(host="127.0.0.1", port=link.port).render_as_string(hide_password=False)
        policy = tmp_path / "config" / "policies.yaml"
        policy.parent.mkdir()
        write_policy(policy, with_dependencies(engines.policy_file, database="fail_open"))
        gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), through, tmp_path, "postgresql",
                           {"SWITCHYARD_KEY_CACHE_TTL_S": "0.3", "SWITCHYARD_USAGE_FLUSH_INTERVAL_S": "0.2"})
        served = 0
        try:
            key = gw.new_key("acme", "pro")
            status, headers, body = chat(gw, key, 5)
            assert status == 200, body
            served += 1
            label = policy_label(headers)

            link.cut()
            time.sleep(0.5)  # past the key cache's TTL (0.3 s): every lookup now needs the database
            for _ in range(3):  # fail_open: the key seen before keeps working, under the same policy
                status, headers, body = chat(gw, key, 5)
                assert status == 200, body
                assert policy_label(headers) == label
                served += 1
            status, headers, body = chat(gw, generate_key(), 5)  # never seen: cannot be checked
            assert status == 503 and body["error"]["code"] == "auth_unavailable", body
            assert int(headers["retry-after"]) >= 1
            status, headers, body = http_json("GET", f"{gw.base_url}/v1/models",
                                              headers={"Authorization": f"Bearer {key}"})
            assert status == 200 and {m["id"] for m in body["data"]} >= {"small", "auto"}
            assert failures(gw, "database", "fail_open") == 4 and failures(gw, "database", "fail_closed") == 1
            status, ready = readyz(gw)
            assert status == 503 and not ready["checks"]["database"]["ok"]
            assert ready["checks"]["policy"]["ok"] and ready["checks"]["policy"]["version"] == label
            assert not ready["checks"]["policy"]["listening"]
            assert ready["dependencies"] == {"limit_store": "ok", "key_lookups": "failing"}

            link.restore()
            wait_for(lambda: readyz(gw)[0] == 200, "/readyz answers 200 again")
            wait_for(lambda: readyz(gw)[1]["checks"]["policy"]["listening"], "the policy LISTEN is back")

            def looked_up() -> bool:
                """Whether a request was served after a key lookup (not from the expired entry)."""
                nonlocal served
                before = failures(gw, "database", "fail_open") + failures(gw, "database", "fail_closed")
                status, _, body = chat(gw, key, 5)
                assert status == 200, body  # fail_open: served either way
                served += 1
                return before == failures(gw, "database", "fail_open") + failures(gw, "database", "fail_closed")

            # After the authenticator's back-off, keys are looked up in the database again.
            wait_for(looked_up, "keys are looked up again")
            # The ledger kept what was served while its flushes failed.
            wait_for(lambda: _ledger_requests(direct, "acme") == served, f"the ledger counts {served} requests")

            # fail_closed (a policy change, picked up after the outage): the key is refused once its entry expired.
            write_policy(policy, with_dependencies(engines.policy_file, database="fail_closed"))
            # Served under the new version, as a chat itself says (a busy full-suite run once saw /readyz
            # name a new version while the chat right after it still said v1; not understood yet).
            def new_version_serves() -> bool:
                status, headers, _ = chat(gw, key, 5)
                return status == 200 and policy_label(headers) != label

            wait_for(new_version_serves, "the new policy serves")
            closed_before = failures(gw, "database", "fail_closed")
            link.cut()
            time.sleep(0.5)
            status, headers, body = chat(gw, key, 5)
            assert status == 503 and body["error"]["code"] == "auth_unavailable", body
            assert int(headers["retry-after"]) >= 1
            assert failures(gw, "database", "fail_closed") == closed_before + 1
            assert readyz(gw)[0] == 503
            link.restore()
            wait_for(lambda: readyz(gw)[0] == 200, "/readyz answers 200 again")
            wait_for(lambda: chat(gw, key, 5)[0] == 200, "the key works again")
        finally:
            link.restore()
            assert stop(gw.proc), "the gateway must stop cleanly once the database is back"
