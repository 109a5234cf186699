"""The usage ledger and limit overrides, on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

import asyncio
import logging
import threading
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, event, inspect, text
from sqlalchemy.exc import DBAPIError

from switchyard.store import db
from switchyard.store.errors import NotFound, StoreError
from switchyard.store.keys import create_key
from switchyard.store.models import ApiKey, TenantCreate
from switchyard.store.tenants import create_tenant, get_tenant
from switchyard.store.usage import UsageRecorder, set_limits, usage

DAY = date(2026, 12, 1)
NOON = datetime(2026, 12, 1, 12, tzinfo=UTC)


@pytest.fixture
def ids(engine: Engine) -> dict[str, int]:
    """Tenants ``acme`` (keys ``a1``, ``a2``) and ``beta`` (key ``b1``), by name to id."""
    with db.session_scope(engine) as s:
        out = {}
        for tenant, keys in (("acme", ("a1", "a2")), ("beta", ("b1",))):
            out[tenant] = create_tenant(s, TenantCreate(name=tenant, tier="free")).id
            for key in keys:
                out[key] = create_key(s, tenant, key)[1].id
    return out


def _rows(engine: Engine, **filters: Any) -> list[tuple[Any, ...]]:
    with db.session_scope(engine) as s:
        report = usage(s, **filters)
    return [(r.tenant, r.key_id, r.model, r.day, r.requests, r.prompt_tokens, r.completion_tokens,
             r.cached_tokens, r.spend) for r in report.rows]


def _rename_ledger(engine: Engine, old: str, new: str) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))


def test_flushes_add_to_the_stored_rows(engine: Engine, ids: dict[str, int]) -> None:
    recorder = UsageRecorder(engine)
    assert recorder.flush() == 0
    recorder.record(ids["acme"], ids["a1"], "small", 100, 20, 0, 0.5, at=NOON)
    recorder.record(ids["acme"], ids["a1"], "small", 50, 10, 40, 0.25, at=NOON)
    recorder.record(ids["beta"], ids["b1"], "large", 7, 3, 0, 1.0, at=NOON)
    assert recorder.pending_rows == 2
    assert recorder.flush() == 2
    assert recorder.pending_rows == 0
    recorder.record(ids["acme"], ids["a1"], "small", 1, 2, 1, 0.125, at=NOON)
    assert recorder.flush() == 1
    assert UsageRecorder(engine).flush() == 0
    assert _rows(engine) == [
        ("acme", ids["a1"], "small", DAY, 3, 151, 32, 41, 0.875),
        ("beta", ids["b1"], "large", DAY, 1, 7, 3, 0, 1.0),
    ]
    with db.session_scope(engine) as s:
        totals = usage(s).totals
    assert (totals.requests, totals.prompt_tokens, totals.completion_tokens, totals.cached_tokens,
            totals.spend) == (4, 158, 35, 41, 1.875)


def test_two_replicas_flushing_the_same_rows_at_once_lose_no_update(database_url: str, engine: Engine,
                                                                      ids: dict[str, int]) -> None:
    rounds, keys = 40, [(ids["acme"], ids["a1"]), (ids["acme"], ids["a2"]), (ids["beta"], ids["b1"])]
    engines = [db.create_db_engine(database_url) for _ in range(2)]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def replica(own: Engine, order: int) -> None:
        recorder = UsageRecorder(own)
        try:
            start.wait()
            for _ in range(rounds):
                for tenant_id, key_id in keys[::order]:  # each replica records in its own order
                    for model in ("small", "large"):
                        recorder.record(tenant_id, key_id, model, 10, 1, 2, 0.25, at=NOON)
                recorder.flush()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(e, order)) for e, order in zip(engines, (1, -1), strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in engines:
        e.dispose()
    assert errors == []
    rows = _rows(engine)
    assert len(rows) == len(keys) * 2
    assert {row[4:] for row in rows} == {(2 * rounds, 20 * rounds, 2 * rounds, 4 * rounds, 0.5 * rounds)}


def test_a_failed_flush_keeps_every_delta_for_the_next(engine: Engine, ids: dict[str, int]) -> None:
    recorder = UsageRecorder(engine)
    recorder.record(ids["acme"], ids["a1"], "small", 100, 10, 0, 0.5, at=NOON)
    _rename_ledger(engine, "usage_daily", "usage_daily_away")  # the table is gone for a while
    with pytest.raises(DBAPIError):
        recorder.flush()
    recorder.record(ids["acme"], ids["a1"], "small", 1, 1, 0, 0.25, at=NOON)
    recorder.record(ids["beta"], ids["b1"], "small", 5, 5, 0, 0.25, at=NOON)
    with pytest.raises(DBAPIError):
        recorder.flush()
    assert recorder.pending_rows == 2
    _rename_ledger(engine, "usage_daily_away", "usage_daily")
    assert recorder.flush() == 2
    assert _rows(engine) == [
        ("acme", ids["a1"], "small", DAY, 2, 101, 11, 0, 0.75),
        ("beta", ids["b1"], "small", DAY, 1, 5, 5, 0, 0.25),
    ]


@pytest.mark.parametrize("fail", [False, True])
def test_what_is_recorded_during_a_flush_waits_for_the_next(engine: Engine, ids: dict[str, int], fail: bool) -> None:
    recorder = UsageRecorder(engine)
    recorder.record(ids["acme"], ids["a1"], "small", 100, 10, 0, 0.5, at=NOON)

    def meanwhile(*_: Any) -> None:
        # Another request finishes while the flush is in the database.
        recorder.record(ids["acme"], ids["a1"], "small", 1, 1, 1, 0.25, at=NOON)
        if fail:
            raise RuntimeError("connection lost")

    event.listen(engine, "before_cursor_execute", meanwhile)
    try:
        if fail:
            with pytest.raises(RuntimeError, match="connection lost"):
                recorder.flush()
        else:
            assert recorder.flush() == 1
    finally:
        event.remove(engine, "before_cursor_execute", meanwhile)
    assert _rows(engine) == ([] if fail else [("acme", ids["a1"], "small", DAY, 1, 100, 10, 0, 0.5)])
    assert recorder.pending_rows == 1
    recorder.flush()
    assert _rows(engine) == [("acme", ids["a1"], "small", DAY, 2, 101, 11, 1, 0.75)]


async def test_run_flushes_periodically_survives_a_failure_and_aclose_flushes_the_rest(
        engine: Engine, ids: dict[str, int], caplog: pytest.LogCaptureFixture) -> None:
    recorder = UsageRecorder(engine)
    task = asyncio.create_task(recorder.run(0.02))

    async def until(condition: Any) -> None:
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    recorder.record(ids["acme"], ids["a1"], "small", 10, 1, 0, 0.5)
    await until(lambda: recorder.pending_rows == 0 and bool(_rows(engine)))  # taken, then committed
    today = datetime.now(UTC).date()
    assert [r[3:5] for r in _rows(engine)] in ([(today, 1)], [(today + timedelta(days=1), 1)])

    _rename_ledger(engine, "usage_daily", "usage_daily_away")
    with caplog.at_level(logging.WARNING, logger="switchyard.usage"):
        recorder.record(ids["acme"], ids["a1"], "small", 10, 1, 0, 0.5, at=NOON)
        await until(lambda: "usage flush failed" in caplog.text)
    assert not task.done() and recorder.pending_rows == 1
    _rename_ledger(engine, "usage_daily_away", "usage_daily")
    await until(lambda: recorder.pending_rows == 0)

    recorder.record(ids["beta"], ids["b1"], "large", 3, 4, 0, 0.25, at=NOON)
    await recorder.aclose()  # stops the loop, then writes what it had not flushed yet
    await asyncio.wait_for(task, 5)
    assert recorder.pending_rows == 0
    assert ("beta", ids["b1"], "large", DAY, 1, 3, 4, 0, 0.25) in _rows(engine)


async def test_aclose_without_run_flushes(engine: Engine, ids: dict[str, int]) -> None:
    recorder = UsageRecorder(engine)
    recorder.record(ids["acme"], ids["a2"], "small", 1, 2, 0, 0.0, at=NOON)
    await recorder.aclose()
    assert _rows(engine) == [("acme", ids["a2"], "small", DAY, 1, 1, 2, 0, 0.0)]


def test_days_are_utc_days_and_the_report_filters(engine: Engine, ids: dict[str, int]) -> None:
    recorder = UsageRecorder(engine)
    new_york = timezone(timedelta(hours=-5))
    a1, b1 = ids["a1"], ids["b1"]
    recorder.record(ids["acme"], a1, "small", 1, 0, 0, 0.0, at=datetime(2026, 12, 1, 23, 59, 59, tzinfo=UTC))
    recorder.record(ids["acme"], a1, "small", 2, 0, 0, 0.0, at=datetime(2026, 12, 2, 0, 0, tzinfo=UTC))
    # 20:00 in New York on 1 December is 01:00 UTC on 2 December.
    recorder.record(ids["acme"], a1, "small", 4, 0, 0, 0.0, at=datetime(2026, 12, 1, 20, 0, tzinfo=new_york))
    recorder.record(ids["beta"], b1, "large", 8, 0, 0, 0.0, at=datetime(2026, 12, 3, 9, 0, tzinfo=UTC))
    with pytest.raises(ValueError, match="naive"):
        recorder.record(ids["acme"], a1, "small", 1, 0, 0, 0.0, at=datetime(2026, 12, 1))
    recorder.flush()
    dec = {d: date(2026, 12, d) for d in (1, 2, 3)}
    assert [(r[0], r[3], r[5]) for r in _rows(engine)] == [
        ("acme", dec[1], 1), ("acme", dec[2], 6), ("beta", dec[3], 8)]
    assert [r[3] for r in _rows(engine, since=dec[2], until=dec[2])] == [dec[2]]
    assert [r[3] for r in _rows(engine, since=dec[2])] == [dec[2], dec[3]]
    assert [r[3] for r in _rows(engine, until=dec[1])] == [dec[1]]
    assert [r[0] for r in _rows(engine, tenant="beta")] == ["beta"]
    assert [r[2] for r in _rows(engine, model="small")] == ["small", "small"]
    assert _rows(engine, tenant="beta", model="small") == []
    with pytest.raises(NotFound), db.session_scope(engine) as s:
        usage(s, tenant="nobody")


def test_limit_overrides_are_validated_against_the_policy_schema(engine: Engine, ids: dict[str, int]) -> None:
    with db.session_scope(engine) as s:
        checked = set_limits(s, tenant="acme", limits={"tokens_per_minute": 5000, "tokens_per_day": None},
                             actor="test", origin="test")
        set_limits(s, key_id=ids["a1"], limits={"requests_per_minute": 10}, actor="test", origin="test")
    assert checked is not None and checked.model_fields_set == {"tokens_per_minute", "tokens_per_day"}

    def stored() -> tuple[Any, Any]:
        with db.session_scope(engine) as s:
            return get_tenant(s, "acme").limits, s.get(ApiKey, ids["a1"]).limits  # type: ignore[union-attr]

    # An explicit null is kept: it lifts that limit of the tier (see decide.admit).
    before = stored()
    assert before == ({"tokens_per_minute": 5000, "tokens_per_day": None}, {"requests_per_minute": 10})
    for bad, message in (
        ({"tokens_per_minute": 0}, "tokens_per_minute: Input should be greater than 0"),
        ({"tokens_per_minute": 200, "tokens_per_day": 100}, "tokens_per_minute (200) exceeds tokens_per_day"),
        ({"tokens_per_hour": 5}, "tokens_per_hour: Extra inputs are not permitted"),
        ([1, 2], "limits: Input should be a valid dictionary"),
    ):
        with pytest.raises(StoreError, match=r"invalid limits for tenant 'acme': .*" + message.split("(")[0]), \
                db.session_scope(engine) as s:
            set_limits(s, tenant="acme", limits=bad, actor="test", origin="test")  # type: ignore[arg-type]
    assert stored() == before

    with db.session_scope(engine) as s:
        assert set_limits(s, tenant="acme", limits=None, actor="test", origin="test") is None
        with pytest.raises(NotFound):
            set_limits(s, key_id=9999, limits={}, actor="test", origin="test")
        with pytest.raises(NotFound):
            set_limits(s, tenant="nobody", limits={}, actor="test", origin="test")
        with pytest.raises(ValueError, match="exactly one"):
            set_limits(s, tenant="acme", key_id=ids["a1"], limits=None, actor="test", origin="test")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT limits IS NULL FROM tenant WHERE name = 'acme'")).scalar_one()


def test_migration_0003_adds_and_removes_the_ledger_and_overrides(database_url: str) -> None:
    engine = db.create_db_engine(database_url)
    try:
        db.upgrade(engine, "0002")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO tenant (id, name, tier, created_at) VALUES (1, 'acme', 'free', :t)"),
                         {"t": NOON})
            conn.execute(text("INSERT INTO api_key (id, tenant_id, prefix, key_hash, created_at) "
                              "VALUES (1, 1, 'sk-sy-abc', 'h', :t)"), {"t": NOON})
        db.upgrade(engine, "0003")
        assert "usage_daily" in inspect(engine).get_table_names()
        assert "limits" in {c["name"] for c in inspect(engine).get_columns("tenant")}
        assert "limits" in {c["name"] for c in inspect(engine).get_columns("api_key")}
        db.upgrade(engine)  # the models (used below) are those of the newest schema
        with db.session_scope(engine) as s:
            assert get_tenant(s, "acme").limits is None
            set_limits(s, tenant="acme", limits={"tokens_per_day": 10}, actor="test", origin="test")
        recorder = UsageRecorder(engine)
        recorder.record(1, 1, "small", 1, 1, 0, 0.0, at=NOON)
        recorder.flush()

        db.downgrade(engine, "0002")
        assert "usage_daily" not in inspect(engine).get_table_names()
        assert "limits" not in {c["name"] for c in inspect(engine).get_columns("tenant")}
        assert "limits" not in {c["name"] for c in inspect(engine).get_columns("api_key")}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM tenant")).scalars().all() == ["acme"]
            assert conn.execute(text("SELECT tenant_id FROM api_key")).scalars().all() == [1]
        db.upgrade(engine)
        assert db.is_current(engine)
    finally:
        engine.dispose()


_RECORD = st.tuples(st.sampled_from(["a1", "a2", "b1"]), st.sampled_from(["small", "large"]),
                    st.integers(0, 10_000), st.integers(0, 2_000), st.integers(0, 100), st.integers(0, 1_000))
_OPS = st.lists(st.one_of(st.just("flush"), _RECORD), max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_the_ledger_always_equals_the_sum_of_what_was_recorded(engine: Engine, ids: dict[str, int],
                                                              ops: list[Any]) -> None:
    """Whatever the interleaving of records and flushes, the stored totals grow by exactly the sum recorded."""
    def totals() -> tuple[int, int, int, int, int]:
        with db.session_scope(engine) as s:
            t = usage(s).totals
        return t.requests, t.prompt_tokens, t.completion_tokens, t.cached_tokens, round(t.spend * 1000)

    before = totals()
    recorder = UsageRecorder(engine)
    expected = [0, 0, 0, 0, 0]
    for op in ops:
        if op == "flush":
            recorder.flush()
            continue
        key, model, prompt, completion, cached, spend_milli = op
        tenant = "acme" if key.startswith("a") else "beta"
        recorder.record(ids[tenant], ids[key], model, prompt, completion, min(cached, prompt), spend_milli / 1000)
        for i, v in enumerate((1, prompt, completion, min(cached, prompt), spend_milli)):
            expected[i] += v
    recorder.flush()
    assert recorder.pending_rows == 0
    after = totals()
    assert tuple(a - b for a, b in zip(after, before, strict=True)) == tuple(expected)
