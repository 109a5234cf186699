"""No tenant sees another's cached answers, files, batches, usage or request-log entries: two tenants of the
same tier on two gateway replicas that share PostgreSQL and Redis (the response cache and the limits
shared too), and a deleted tenant's leftovers on SQLite.

Covered elsewhere, not repeated here: one gateway's in-process cache keeps tenant entries to their tenant
and serves ``scope: global`` ones to all (``test_cache.py::test_tenant_entries_are_never_served_to_another_
tenant_but_global_ones_are``); files and batches answer another tenant 404 on every route, listing and
cursor (``test_batch_api.py::test_no_tenant_sees_another_tenants_files_or_batches``, SQLite and PostgreSQL;
the store in ``test_batch_store.py``; a finished batch's output in ``test_batch_worker.py``).
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import Engine

from switchyard.store import db
from switchyard.store.keys import create_key, list_keys
from switchyard.store.models import TenantCreate
from switchyard.store.tenants import create_tenant, delete_tenant, list_tenants
from switchyard.store.usage import UsageRecorder, usage
from tests.integration.conftest import Engines, Gateway, eventually, http_json, start_gateway, stop

LIMIT = 100_000  # tokens per day of the tier (what it refills in a second is a token or two)


def _policy(engines: Engines) -> str:
    def eps(pool: str) -> str:
        return "[" + ", ".join(engines.url(pool, i) for i in range(len(engines.ports[pool]))) + "]"

    return f"""\
schema: 1
regions: [us-east]
pools:
  - {{name: small-us, region: us-east, served_model: sim-small, endpoints: {eps("small-us")}, kv_cache_tokens: 200000}}
models:
  - {{name: small, pools: [small-us], context_window: 8192, price: {{input_per_mtok: 1, output_per_mtok: 1}}}}
  - {{name: public, pools: [small-us], context_window: 8192, price: {{input_per_mtok: 1, output_per_mtok: 1}}}}
priorities:
  standard: {{max_queue_ms: 1000}}
tiers:
  - {{name: pro, priority: standard, models: ["*"], limits: {{tokens_per_day: {LIMIT}}}}}
cache:
  - {{name: private, match: {{models: [small]}}, ttl: 1h}}
  - {{name: shared, match: {{models: [public]}}, ttl: 1h, scope: global}}
tests:
  - {{request: {{model: small, tier: pro, prompt: hi}}, expect: {{model: small}}}}
"""


@pytest.fixture(scope="module")
def pair(engines: Engines, tmp_path_factory: pytest.TempPathFactory,
         pg_database: Callable[[], str]) -> Iterator[tuple[Gateway, Gateway]]:
    """Two replicas on one PostgreSQL database and one Redis (response cache and limits shared), with keys
    of tenants ``a`` and ``b`` of one tier."""
    tmp = tmp_path_factory.mktemp("isolation")
    policy = tmp / "policies.yaml"
    policy.write_text(_policy(engines))
    ours = Engines(policy, engines.ports, engines.dead_port)
    env = {"SWITCHYARD_REDIS_URL": "redis://127.0.0.1:6379/0",
           "SWITCHYARD_REDIS_KEY_PREFIX": f"sy-iso-{uuid.uuid4().hex[:8]}:", "SWITCHYARD_BATCH_WORKER": "false",
           "SWITCHYARD_USAGE_FLUSH_INTERVAL_S": "0.3", "SWITCHYARD_REQUEST_LOG_FLUSH_INTERVAL_S": "0.3"}
    url = pg_database()
    one = start_gateway(ours, url, tmp / "one", "postgresql", env)
    try:
        two = start_gateway(ours, url, tmp / "two", "postgresql", env)
    except BaseException:
        stop(one.proc)
        raise
    one.keys = two.keys = {"a": one.new_key("iso-a", "pro"), "b": one.new_key("iso-b", "pro")}
    try:
        yield one, two
    finally:
        assert stop(one.proc) and stop(two.proc)


def sdk(gw: Gateway, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys[who], max_retries=0, timeout=60)


def ask(gw: Gateway, who: str, text: str, model: str = "small", **extra: Any) -> tuple[str, dict[str, str]]:
    """A deterministic chat (temperature 0 unless given); its answer and headers."""
    extra.setdefault("temperature", 0)
    raw = sdk(gw, who).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=8, **extra)
    return raw.parse().choices[0].message.content or "", {k.lower(): v for k, v in raw.headers.items()}


def cache_of(headers: dict[str, str]) -> str:
    return headers.get("x-switchyard-cache", "").split(";")[0]


@pytest.mark.postgres
@pytest.mark.redis
def test_a_cached_answer_reaches_no_other_tenant_on_any_replica(pair: tuple[Gateway, Gateway]) -> None:
    one, two = pair
    for n, (stored_on, asked_on, stream) in enumerate([(one, one, False), (one, two, False), (two, one, True),
                                                       (two, two, True)]):
        text = f"What is in our private roadmap, part {n}?"
        ask(stored_on, "a", text)
        elsewhere = two if stored_on is one else one
        assert cache_of(ask(elsewhere, "a", text)[1]) == "hit"  # stored, and shared by the replicas...
        raw = sdk(asked_on, "b").chat.completions.with_raw_response.create(  # ... with its tenant only
            model="small", messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0, stream=stream)
        assert cache_of({k.lower(): v for k, v in raw.headers.items()}) == "miss", (n, stream)
        if stream:
            for _chunk in raw.parse():
                pass
    # A rule that says scope: global shares on purpose.
    ask(one, "a", "What is the boiling point of water?", model="public")
    assert cache_of(ask(two, "b", "What is the boiling point of water?", model="public")[1]) == "hit"


@pytest.mark.postgres
@pytest.mark.redis
def test_files_and_batches_stay_with_their_tenant_across_replicas(pair: tuple[Gateway, Gateway]) -> None:
    one, two = pair
    line = (b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "small", '
            b'"messages": [{"role": "user", "content": "x"}]}}\n')
    uploaded = sdk(one, "a").files.create(file=("mine.jsonl", line, "application/jsonl"), purpose="batch")
    batch = sdk(one, "a").batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h")
    stranger = sdk(two, "b")
    for call in (stranger.files.retrieve, stranger.files.content, stranger.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(uploaded.id)
    for batch_call in (stranger.batches.retrieve, stranger.batches.cancel):
        with pytest.raises(openai.NotFoundError):
            batch_call(batch.id)
    assert uploaded.id not in {f.id for f in stranger.files.list()}
    assert batch.id not in {b.id for b in stranger.batches.list()}
    assert sdk(two, "a").batches.retrieve(batch.id).status == "in_progress"  # the owner sees it on either


@pytest.mark.postgres
@pytest.mark.redis
def test_one_tenants_usage_is_not_anothers(pair: tuple[Gateway, Gateway]) -> None:
    """Limits are counted per tenant (one tenant's use leaves another's budget whole, across replicas), and
    the usage ledger and request log, which only the admin token reads, filter by tenant exactly."""
    one, two = pair
    one.keys.update(c=one.new_key("iso-c", "pro"), d=one.new_key("iso-d", "pro"))  # budgets untouched so far
    for n in range(3):  # uncached (temperature 1): each draws on c's budget
        _, c_headers = ask(one, "c", f"Use some of c's budget, please ({n}).", temperature=1)
    _, d_headers = ask(two, "d", "Use some of d's budget, please (0).", temperature=1)
    c_left, d_left = int(c_headers["x-ratelimit-remaining-tokens"]), int(d_headers["x-ratelimit-remaining-tokens"])
    assert d_left > c_left and LIMIT - d_left < (LIMIT - c_left) / 2, (c_left, d_left)

    def ledger(tenant: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = http_json("GET", f"{one.base_url}/admin/api/usage?tenant={tenant}")[2]["rows"]
        return rows

    assert eventually(lambda: ledger("iso-c") and ledger("iso-d"))
    assert {r["tenant"] for r in ledger("iso-c")} == {"iso-c"} and {r["tenant"] for r in ledger("iso-d")} == {"iso-d"}
    assert sum(r["requests"] for r in ledger("iso-d")) == 1
    for gw, tenant in ((one, "iso-c"), (two, "iso-d")):  # each replica's recent requests, by tenant
        rows = http_json("GET", f"{gw.base_url}/admin/api/requests?tenant={tenant}")[2]["requests"]
        assert rows and {r["tenant"] for r in rows} == {tenant}


@pytest.mark.postgres
@pytest.mark.redis
def test_a_tenants_key_opens_no_admin_view(pair: tuple[Gateway, Gateway]) -> None:
    """Usage, the request log and the audit log are the admin's: a tenant's API key is not the admin token
    (401), and the console wants a login of its own."""
    one, _ = pair
    _, headers = ask(one, "b", "Something of b's.")
    b_request = headers["x-request-id"]
    key = {"Authorization": f"Bearer {one.keys['a']}"}
    for path in ("/admin/api/usage", "/admin/api/usage?tenant=iso-b", "/admin/api/requests",
                 f"/admin/api/requests/{b_request}", "/admin/api/audit", "/admin/api/cache"):
        status, _, body = http_json("GET", one.base_url + path, headers=key)
        assert status == 401 and body["error"]["code"] == "invalid_admin_token", path
    for page in ("/admin/requests", f"/admin/requests/{b_request}", "/admin/usage"):
        answer = httpx.get(one.base_url + page, headers=key, follow_redirects=False, timeout=30)
        assert answer.status_code in (302, 303) and "/admin/login" in answer.headers["location"], page


def test_a_deleted_tenants_leftovers_reach_no_new_tenant(engines: Engines, tmp_path: Path) -> None:
    """On SQLite a deleted tenant's id (and its keys' ids) would be given again to the next tenant; the
    response cache (in process here), the limit counters and the request log are keyed by them. The next
    tenant gets new ids, so none of it reaches it."""
    policy = tmp_path / "policies.yaml"
    policy.write_text(_policy(engines))
    gw = start_gateway(Engines(policy, engines.ports, engines.dead_port), f"sqlite:///{tmp_path / 'gw.db'}", tmp_path,
                       "sqlite", {"SWITCHYARD_BATCH_WORKER": "false", "SWITCHYARD_USAGE_FLUSH_INTERVAL_S": "3"})
    try:
        gw.keys = {"old": gw.new_key("leaving", "pro")}
        ask(gw, "old", "The departing tenant's secret plan.")
        assert cache_of(ask(gw, "old", "The departing tenant's secret plan.")[1]) == "hit"
        line = (b'{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "small", '
                b'"messages": [{"role": "user", "content": "x"}]}}\n')
        uploaded = sdk(gw, "old").files.create(file=("plan.jsonl", line, "application/jsonl"), purpose="batch")
        batch = sdk(gw, "old").batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")
        refused = gw.cli("tenants", "delete", "leaving", "--yes", check=False)
        assert refused.returncode != 0 and "cancel them" in refused.stderr  # its batch could still run lines
        sdk(gw, "old").batches.cancel(batch.id)
        ids = {t["name"]: t["id"] for t in tenants_of(gw)}
        ask(gw, "old", "A last word before leaving.", temperature=1)  # its usage not yet written (every 3 s)
        deleted = gw.cli("tenants", "delete", "leaving", "--yes")
        assert "1 key(s), 2 file(s), 1 batch(es)" in deleted.stdout  # the upload and the cancelled batch's errors
        with sqlite3.connect(tmp_path / "gw.db") as conn:
            assert conn.execute("SELECT count(*) FROM batch_file").fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM api_key").fetchone() == (0,)
        gw.keys["new"] = gw.new_key("arriving", "pro")
        arriving = {t["name"]: t["id"] for t in tenants_of(gw)}["arriving"]
        assert arriving > ids["leaving"], "a deleted tenant's id was given again"
        assert cache_of(ask(gw, "new", "The departing tenant's secret plan.")[1]) == "miss"
        with pytest.raises(openai.AuthenticationError):
            ask(gw, "old", "The departing tenant's secret plan.")
        # The deleted key's unwritten usage cannot be written (its rows are gone): it is dropped, and the
        # ledger goes on with everyone else's.
        def ledger() -> int:
            report = json.loads(gw.cli("usage", "--tenant", "arriving", "--json").stdout)
            return int(report["totals"]["requests"])

        assert eventually(ledger, timeout=15) == 1
    finally:
        assert stop(gw.proc)


def tenants_of(gw: Gateway) -> list[dict[str, Any]]:
    """``switchyard tenants list --json``."""
    rows: list[dict[str, Any]] = json.loads(gw.cli("tenants", "list", "--json").stdout)
    return rows


def test_usage_of_a_deleted_tenant_not_yet_written_does_not_jam_the_ledger(engine: Engine) -> None:
    """The gateways write usage every few seconds; a tenant deleted in between leaves rows that can never
    be written (their key is gone). They are dropped, and everyone else's usage is written."""
    with db.session_scope(engine) as session:
        for name in ("gone", "stays"):
            create_tenant(session, TenantCreate(name=name, tier="pro"))
            create_key(session, name)
        ids = {k.tenant: (k.id, t.id) for k in list_keys(session) for t in list_tenants(session) if t.name == k.tenant}
    recorder = UsageRecorder(engine)
    for name in ("gone", "stays"):
        key_id, tenant_id = ids[name]
        recorder.record(tenant_id, key_id, "small", 10, 5, 0, 0.01)
    with db.session_scope(engine) as session:
        delete_tenant(session, "gone", actor="test", origin="test")
    assert recorder.flush() == 2 and recorder.pending_rows == 0
    with db.session_scope(engine) as session:
        assert [(r.tenant, r.requests) for r in usage(session).rows] == [("stays", 1)]
