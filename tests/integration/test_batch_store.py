"""The Batch API's store (``store.files``, ``store.batches``, ``store.batch_queue``, ``store.batch_finalize``)
on SQLite and on the real PostgreSQL server: files scoped to their tenant, input validation (``batch.intake``),
and the workers' primitives (claim, leases, exactly-once results, finalization, cancellation, expiry),
concurrent callers included."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.batch.intake import create_batch
from switchyard.store import db
from switchyard.store.batch_finalize import finalize_ready
from switchyard.store.batch_queue import claim, put_back, record_result, release, renew_leases, retry_later
from switchyard.store.batches import cancel_batch, get_batch, list_batches, request_states
from switchyard.store.errors import Conflict, InvalidParam, NotFound, TooLarge
from switchyard.store.files import MAX_LINES, create_file, delete_file, file_content, get_file, list_files
from switchyard.store.keys import create_key
from switchyard.store.models import Batch, TenantCreate
from switchyard.store.tenants import create_tenant

T = TypeVar("T")
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
EP = "/v1/chat/completions"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def line(custom_id: str, content: str = "hi", url: str = EP, **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "small", "messages": [{"role": "user", "content": content}], **extra}}


def jsonl(*lines: Any) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def tx(engine: Engine, work: Callable[[Session], T]) -> T:
    with db.session_scope(engine) as s:
        return work(s)


def tenant(engine: Engine, name: str) -> tuple[int, int]:
    """A tenant and a key of it: (tenant_id, key_id)."""
    def make(s: Session) -> tuple[int, int]:
        t = create_tenant(s, TenantCreate(name=name, tier="pro"))
        _, key = create_key(s, name)
        return t.id, key.id

    return tx(engine, make)


def new_batch(engine: Engine, who: tuple[int, int], content: bytes, now: datetime = T0) -> Batch:
    def make(s: Session) -> Batch:
        f = create_file(s, who[0], "in.jsonl", content, now=now)
        return create_batch(s, tenant_id=who[0], key_id=who[1], input_file_id=f.id, endpoint=EP, now=now)

    return tx(engine, make)


def output(engine: Engine, tenant_id: int, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    _, content = tx(engine, lambda s: file_content(s, tenant_id, file_id))
    return [json.loads(x) for x in content.splitlines()]


def test_files_are_scoped_to_their_tenant_and_paginated(engine: Engine) -> None:
    acme, other = tenant(engine, "acme"), tenant(engine, "other")
    ids = [tx(engine, lambda s, i=i: create_file(s, acme[0], f"f{i}.jsonl", jsonl(line("a")), now=at(i)).id)
           for i in range(3)]
    info = tx(engine, lambda s: get_file(s, acme[0], ids[0]))
    assert (info.filename, info.purpose, info.size) == ("f0.jsonl", "batch", len(jsonl(line("a"))))
    assert tx(engine, lambda s: file_content(s, acme[0], ids[0]))[1] == jsonl(line("a"))

    first, more = tx(engine, lambda s: list_files(s, acme[0], limit=2))
    assert [f.id for f in first] == [ids[2], ids[1]] and more
    rest, more = tx(engine, lambda s: list_files(s, acme[0], limit=2, after=ids[1]))
    assert [f.id for f in rest] == [ids[0]] and not more
    ascending, _ = tx(engine, lambda s: list_files(s, acme[0], order="asc", after=ids[0]))
    assert [f.id for f in ascending] == ids[1:]

    # Another tenant finds nothing: not the file, its content, a listing, a deletion or a cursor.
    assert tx(engine, lambda s: list_files(s, other[0])) == ([], False)
    for call in (get_file, file_content, delete_file):
        with pytest.raises(NotFound):
            tx(engine, lambda s, c=call: c(s, other[0], ids[0]))  # type: ignore[operator]
    with pytest.raises(NotFound):
        tx(engine, lambda s: list_files(s, other[0], after=ids[0]))
    with pytest.raises(NotFound):
        tx(engine, lambda s: create_batch(s, tenant_id=other[0], key_id=other[1], input_file_id=ids[0],
                                          endpoint=EP))

    tx(engine, lambda s: delete_file(s, acme[0], ids[0]))
    with pytest.raises(NotFound):
        tx(engine, lambda s: get_file(s, acme[0], ids[0]))


def test_file_limits(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    with pytest.raises(TooLarge):
        tx(engine, lambda s: create_file(s, acme[0], "big.jsonl", b"x" * 101, max_bytes=100))
    with pytest.raises(InvalidParam, match="purpose") as bad:
        tx(engine, lambda s: create_file(s, acme[0], "f.jsonl", b"{}", purpose="fine-tune"))
    assert bad.value.param == "purpose"
    with pytest.raises(InvalidParam, match="at most 50000"):
        tx(engine, lambda s: create_file(s, acme[0], "f.jsonl", b"{}\n" * (MAX_LINES + 1)))
    assert tx(engine, lambda s: list_files(s, acme[0])) == ([], False)


def test_a_bad_input_file_makes_a_failed_batch_that_names_each_bad_line(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    content = jsonl(line("a"), b"{not json", line("a"), line("c", url="/v1/completions"),
                    {"custom_id": "d", "method": "POST", "url": EP, "body": {"messages": []}},
                    {**line("e"), "method": "GET"}, b"", b"[1, 2]", line("g", stream=True), line("h"))
    batch = new_batch(engine, acme, content)
    assert batch.status == "failed" and batch.failed_at == T0 and batch.in_progress_at is None
    assert batch.total_count == 0
    assert batch.errors is not None and batch.errors["object"] == "list"
    got = [(e["line"], e["code"], e["param"]) for e in batch.errors["data"]]
    assert got == [(2, "invalid_json_line", None), (3, "duplicate_custom_id", "custom_id"),
                   (4, "url_mismatch", "url"), (5, "missing_required_parameter", "body.model"),
                   (6, "invalid_value", "method"), (8, "invalid_json_line", None),
                   (9, "invalid_value", "body.stream")]
    assert "line 1" in batch.errors["data"][1]["message"]
    assert tx(engine, lambda s: request_states(s, batch.id)) == {}  # no lines written

    empty = new_batch(engine, acme, b"\n\n")
    assert empty.status == "failed" and empty.errors is not None
    assert [e["code"] for e in empty.errors["data"]] == ["empty_file"]


def test_batch_parameters_are_checked(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    f = tx(engine, lambda s: create_file(s, acme[0], "in.jsonl", jsonl(line("a"))))
    for kwargs, param in (({"endpoint": "/v1/moderations"}, "endpoint"), ({"completion_window": "1h"},
                          "completion_window"), ({"metadata": {"k": "v" * 513}}, "metadata"),
                          ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata")):
        args: dict[str, Any] = {"endpoint": EP, **kwargs}
        with pytest.raises(InvalidParam) as bad:
            tx(engine, lambda s, a=args: create_batch(s, tenant_id=acme[0], key_id=acme[1], input_file_id=f.id,
                                                      **a))
        assert bad.value.param == param


def test_a_good_file_makes_one_pending_line_per_request(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(*(line(f"r{i}") for i in range(5))))
    assert (batch.status, batch.total_count, batch.in_progress_at) == ("in_progress", 5, T0)
    assert batch.expires_at == T0 + timedelta(hours=24)
    assert tx(engine, lambda s: request_states(s, batch.id)) == {"pending": 5}
    again = tx(engine, lambda s: get_batch(s, acme[0], batch.id))
    assert (again.status, again.total_count) == ("in_progress", 5)
    listed, more = tx(engine, lambda s: list_batches(s, acme[0]))
    assert [x.id for x in listed] == [batch.id] and not more


def test_claim_leases_and_a_stale_owner_result_is_dropped(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(*(line(f"r{i}") for i in range(3))))
    first = tx(engine, lambda s: claim(s, "w1", 2, 30, at(1)))
    assert [(c.custom_id, c.attempts, c.batch_id, c.tenant_id, c.key_id, c.endpoint) for c in first] == [
        ("r0", 1, batch.id, acme[0], acme[1], EP), ("r1", 1, batch.id, acme[0], acme[1], EP)]
    assert first[0].body["messages"][0]["content"] == "hi" and first[0].lease_until == at(31)
    # Leased lines are not claimed again while the lease holds.
    second = tx(engine, lambda s: claim(s, "w2", 5, 30, at(2)))
    assert [c.custom_id for c in second] == ["r2"]
    assert tx(engine, lambda s: claim(s, "w2", 5, 30, at(3))) == []

    # w1 dies; once its leases run out its lines go to w2 (a new try), as do unix-second times.
    taken = tx(engine, lambda s: claim(s, "w2", 5, 30, at(31.5).timestamp()))
    assert [(c.custom_id, c.attempts) for c in taken] == [("r0", 2), ("r1", 2)]
    # w1's late result is dropped; w2's counts, once only.
    assert not tx(engine, lambda s: record_result(s, first[0].id, "w1", 200, {"late": True}, None, at(33)))
    assert tx(engine, lambda s: record_result(s, taken[0].id, "w2", 200, {"ok": 1}, None, at(33)))
    assert not tx(engine, lambda s: record_result(s, taken[0].id, "w2", 200, {"ok": 2}, None, at(33)))
    # A lease that ran out but nobody claimed since still belongs to its owner.
    assert tx(engine, lambda s: record_result(s, second[0].id, "w2", 200, {"ok": 3}, None, at(100)))
    got = tx(engine, lambda s: get_batch(s, acme[0], batch.id))
    assert (got.completed_count, got.failed_count) == (2, 0)
    assert tx(engine, lambda s: request_states(s, batch.id)) == {"succeeded": 2, "running": 1}


def test_renew_release_and_retry(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(line("a"), line("b")))
    a, bb = tx(engine, lambda s: claim(s, "w", 2, 10, at(0)))
    # A renewed lease holds past its first end; a line the worker lost is not renewed.
    assert tx(engine, lambda s: renew_leases(s, "w", [a.id, bb.id], 10, at(8))) == [a.id, bb.id]
    assert tx(engine, lambda s: claim(s, "x", 2, 10, at(15))) == []
    assert tx(engine, lambda s: renew_leases(s, "x", [a.id], 10, at(15))) == []

    # Handed back untried: due at once, the attempt not counted.
    assert tx(engine, lambda s: release(s, "w", [bb.id], at(16))) == 1
    again = tx(engine, lambda s: claim(s, "x", 2, 10, at(16)))
    assert [(c.custom_id, c.attempts) for c in again] == [("b", 1)]
    assert tx(engine, lambda s: record_result(s, again[0].id, "x", 200, {"answer": "b"}, None, at(16)))

    # A transient failure: pending again, due after the delay, then a new try.
    err = {"code": "upstream_overloaded", "message": "busy"}
    assert tx(engine, lambda s: retry_later(s, a.id, "w", 60, err, at(17)))
    assert not tx(engine, lambda s: retry_later(s, a.id, "w", 60, err, at(17)))  # no longer w's
    assert tx(engine, lambda s: claim(s, "w", 2, 10, at(70))) == []
    retried = tx(engine, lambda s: claim(s, "w", 2, 10, at(77)))
    assert [(c.custom_id, c.attempts) for c in retried] == [("a", 2)]
    # Out of tries: failed for good, counted, with the error and no response.
    assert tx(engine, lambda s: retry_later(s, a.id, "w", 60, err, at(78), max_attempts=2))
    got = tx(engine, lambda s: get_batch(s, acme[0], batch.id))
    assert (got.completed_count, got.failed_count) == (1, 1)
    assert tx(engine, lambda s: request_states(s, batch.id)) == {"failed": 1, "succeeded": 1}
    assert tx(engine, lambda s: finalize_ready(s, at(79))) == [batch.id]
    (failed,) = output(engine, acme[0], tx(engine, lambda s: get_batch(s, acme[0], batch.id)).error_file_id)
    assert (failed["custom_id"], failed["response"], failed["error"]) == ("a", None, err)


def test_lines_a_full_lane_refused_go_back_together_each_due_after_its_delay(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    new_batch(engine, acme, jsonl(line("a"), line("b"), line("c")))
    a, bb, c = tx(engine, lambda s: claim(s, "w", 3, 30, at(0)))
    full = {"code": "batch_lane_full", "message": "full"}
    # One statement for both refusals; a line no longer this worker's (c, handed back) is left alone.
    assert tx(engine, lambda s: release(s, "w", [c.id], at(1))) == 1
    tx(engine, lambda s: put_back(s, "w", [(a.id, 5, full), (bb.id, 20, full), (c.id, 5, full)], at(2)))
    assert tx(engine, lambda s: request_states(s, a.batch_id)) == {"pending": 3}
    # Due after each one's delay, with the try given back (the lane had no room: nothing failed).
    assert [x.custom_id for x in tx(engine, lambda s: claim(s, "x", 3, 30, at(3)))] == ["c"]
    again = tx(engine, lambda s: claim(s, "x", 3, 30, at(8)))
    assert [(x.custom_id, x.attempts) for x in again] == [("a", 1)]
    assert [(x.custom_id, x.attempts) for x in tx(engine, lambda s: claim(s, "x", 3, 30, at(23)))] == [("b", 1)]


def test_finalize_writes_output_and_error_files_in_input_order(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(*(line(f"r{i}") for i in range(5))), now=at(0))
    claimed = {c.custom_id: c for c in tx(engine, lambda s: claim(s, "w", 5, 30, at(1)))}
    assert tx(engine, lambda s: finalize_ready(s, at(2))) == []  # lines still running

    def answer(cid: str, status: int | None, body: dict[str, Any] | None, error: dict[str, Any] | None) -> bool:
        return tx(engine, lambda s: record_result(s, claimed[cid].id, "w", status, body, error, at(3),
                                                  request_id=f"req-{cid}"))

    # Results come in any order; a duplicate of one is dropped.
    assert answer("r3", 200, {"answer": 3}, None)
    assert answer("r0", 200, {"answer": 0}, None)
    assert answer("r1", 400, {"error": {"message": "bad"}}, None)
    assert not answer("r0", 200, {"answer": "again"}, None)
    assert answer("r4", None, None, {"code": "invalid_api_key", "message": "revoked"})
    assert tx(engine, lambda s: finalize_ready(s, at(4))) == []  # r2 still running
    assert answer("r2", 200, {"answer": 2}, None)
    assert tx(engine, lambda s: finalize_ready(s, at(5))) == [batch.id]
    assert tx(engine, lambda s: finalize_ready(s, at(6))) == []

    done = tx(engine, lambda s: get_batch(s, acme[0], batch.id))
    assert (done.status, done.finalizing_at, done.completed_at) == ("completed", at(5), at(5))
    assert (done.total_count, done.completed_count, done.failed_count) == (5, 3, 2)
    out = output(engine, acme[0], done.output_file_id)
    assert [(o["custom_id"], o["response"]["body"]["answer"]) for o in out] == [("r0", 0), ("r2", 2), ("r3", 3)]
    assert out[0] == {"id": f"batch_req_{claimed['r0'].id}", "custom_id": "r0", "error": None,
                      "response": {"status_code": 200, "request_id": "req-r0", "body": {"answer": 0}}}
    errors = output(engine, acme[0], done.error_file_id)
    assert [(e["custom_id"], e["response"] and e["response"]["status_code"], e["error"]) for e in errors] == [
        ("r1", 400, None), ("r4", None, {"code": "invalid_api_key", "message": "revoked"})]
    files = {f.id: f for f in tx(engine, lambda s: list_files(s, acme[0]))[0]}
    assert files[done.output_file_id].purpose == "batch_output"  # type: ignore[index]
    assert files[done.output_file_id].filename == f"{batch.id}_output.jsonl"  # type: ignore[index]


def test_all_failed_makes_no_output_file(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(line("a")))
    (a,) = tx(engine, lambda s: claim(s, "w", 5, 30, at(1)))
    tx(engine, lambda s: record_result(s, a.id, "w", 403, {"error": {"message": "no"}}, None, at(2)))
    assert tx(engine, lambda s: finalize_ready(s, at(3))) == [batch.id]
    done = tx(engine, lambda s: get_batch(s, acme[0], batch.id))
    assert done.status == "completed" and done.output_file_id is None and done.error_file_id is not None


def test_cancel(engine: Engine) -> None:
    acme, other = tenant(engine, "acme"), tenant(engine, "other")
    # Nothing running: cancelled at once; what never ran is in the error file, not in the counts.
    idle = new_batch(engine, acme, jsonl(line("a"), line("b")))
    with pytest.raises(NotFound):
        tx(engine, lambda s: cancel_batch(s, other[0], idle.id, at(1)))
    cancelled = tx(engine, lambda s: cancel_batch(s, acme[0], idle.id, at(1)))
    assert (cancelled.status, cancelled.cancelling_at, cancelled.cancelled_at) == ("cancelled", at(1), at(1))
    assert (cancelled.completed_count, cancelled.failed_count, cancelled.output_file_id) == (0, 0, None)
    assert [(e["custom_id"], e["error"]["code"]) for e in output(engine, acme[0], cancelled.error_file_id)] == [
        ("a", "batch_cancelled"), ("b", "batch_cancelled")]
    assert tx(engine, lambda s: cancel_batch(s, acme[0], idle.id, at(2))).status == "cancelled"

    # A line running: cancelling until it finishes; nothing else is claimed meanwhile.
    busy = new_batch(engine, acme, jsonl(line("a"), line("b"), line("c")))
    (a,) = tx(engine, lambda s: claim(s, "w", 1, 30, at(1)))
    assert tx(engine, lambda s: cancel_batch(s, acme[0], busy.id, at(2))).status == "cancelling"
    assert tx(engine, lambda s: claim(s, "w", 5, 30, at(3))) == []
    assert tx(engine, lambda s: finalize_ready(s, at(4))) == []
    assert tx(engine, lambda s: record_result(s, a.id, "w", 200, {"answer": "a"}, None, at(5)))
    assert tx(engine, lambda s: finalize_ready(s, at(6))) == [busy.id]
    done = tx(engine, lambda s: get_batch(s, acme[0], busy.id))
    assert (done.status, done.cancelled_at, done.completed_count, done.failed_count) == ("cancelled", at(6), 1, 0)
    assert [o["custom_id"] for o in output(engine, acme[0], done.output_file_id)] == ["a"]
    assert [e["custom_id"] for e in output(engine, acme[0], done.error_file_id)] == ["b", "c"]
    completed = new_batch(engine, acme, jsonl(line("z")))
    (z,) = tx(engine, lambda s: claim(s, "w", 1, 30, at(7)))
    tx(engine, lambda s: record_result(s, z.id, "w", 200, {}, None, at(8)))
    assert tx(engine, lambda s: finalize_ready(s, at(9))) == [completed.id]
    with pytest.raises(Conflict, match="completed"):
        tx(engine, lambda s: cancel_batch(s, acme[0], completed.id, at(10)))


def test_a_crashed_worker_does_not_hold_a_cancel_up(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(line("a"), line("b")))
    (a,) = tx(engine, lambda s: claim(s, "dead", 1, 30, at(1)))
    assert tx(engine, lambda s: cancel_batch(s, acme[0], batch.id, at(2))).status == "cancelling"
    assert tx(engine, lambda s: finalize_ready(s, at(31))) == [batch.id]  # its lease ran out
    assert not tx(engine, lambda s: record_result(s, a.id, "dead", 200, {}, None, at(32)))
    done = tx(engine, lambda s: get_batch(s, acme[0], batch.id))
    assert (done.status, done.completed_count, done.failed_count, done.output_file_id) == ("cancelled", 0, 0, None)


def test_expiry(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(line("a"), line("b"), line("c")), now=at(0))
    a, bb = tx(engine, lambda s: claim(s, "w", 2, 30, at(1)))
    assert tx(engine, lambda s: record_result(s, a.id, "w", 200, {"answer": "a"}, None, at(2)))
    end = batch.expires_at
    # Nothing is claimed once the window is over, even before a finalizer notices.
    assert tx(engine, lambda s: claim(s, "w", 5, 30, end)) == []
    assert tx(engine, lambda s: finalize_ready(s, end)) == [batch.id]
    assert not tx(engine, lambda s: record_result(s, bb.id, "w", 200, {}, None, end))  # too late: dropped
    done = tx(engine, lambda s: get_batch(s, acme[0], batch.id))
    assert (done.status, done.expired_at, done.completed_count, done.failed_count) == ("expired", end, 1, 0)
    assert [o["custom_id"] for o in output(engine, acme[0], done.output_file_id)] == ["a"]
    assert [(e["custom_id"], e["response"], e["error"]["code"])
            for e in output(engine, acme[0], done.error_file_id)] == [("b", None, "batch_expired"),
                                                                       ("c", None, "batch_expired")]
    assert tx(engine, lambda s: request_states(s, batch.id)) == {"succeeded": 1, "failed": 2}


def _in_threads(n: int, work: Callable[[int], T]) -> list[T]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait(10)
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_concurrent_claimers_never_share_a_line(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(*(line(f"r{i}") for i in range(120))))

    def drain(i: int) -> list[int]:
        mine: list[int] = []
        while got := tx(engine, lambda s: claim(s, f"w{i}", 7, 30, at(1))):
            mine += [c.id for c in got]
        return mine

    per_worker = _in_threads(4, drain)
    every = [row for rows in per_worker for row in rows]
    assert len(every) == 120 and len(set(every)) == 120
    assert tx(engine, lambda s: request_states(s, batch.id)) == {"running": 120}


def test_postgres_claims_skip_locked_lines(pg_database: Callable[[], str]) -> None:
    """Two open transactions claim at once: the second gets other lines at once, not the first's
    (PostgreSQL's row locks with SKIP LOCKED; SQLite has one writer at a time)."""
    engine = db.create_db_engine(pg_database())
    try:
        db.upgrade(engine)
        acme = tenant(engine, "acme")
        new_batch(engine, acme, jsonl(*(line(f"r{i}") for i in range(10))))
        with db.session_scope(engine) as first:
            held = claim(first, "w1", 4, 30, at(1))  # not committed: its rows stay locked
            other = _in_threads(1, lambda _i: tx(engine, lambda s: claim(s, "w2", 10, 30, at(1))))[0]
        assert [c.custom_id for c in held] == ["r0", "r1", "r2", "r3"]
        assert [c.custom_id for c in other] == [f"r{i}" for i in range(4, 10)]
    finally:
        engine.dispose()


def test_concurrent_finalizers_end_a_batch_once(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(*(line(f"r{i}") for i in range(6))))
    for c in tx(engine, lambda s: claim(s, "w", 6, 30, at(1))):
        tx(engine, lambda s, c=c: record_result(s, c.id, "w", 200, {"n": c.custom_id}, None, at(2)))
    ended = _in_threads(3, lambda _i: tx(engine, lambda s: finalize_ready(s, at(3))))
    assert sorted(ended, key=len) == [[], [], [batch.id]]
    done = tx(engine, lambda s: get_batch(s, acme[0], batch.id))
    assert [o["custom_id"] for o in output(engine, acme[0], done.output_file_id)] == [f"r{i}" for i in range(6)]
    assert len(tx(engine, lambda s: list_files(s, acme[0], purpose="batch_output"))[0]) == 1


def test_the_largest_batch(engine: Engine) -> None:
    """50,000 lines go in with their batch in one transaction, and are claimed in order."""
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(*(line(f"r{i}") for i in range(MAX_LINES))))
    assert (batch.status, batch.total_count) == ("in_progress", MAX_LINES)
    assert [c.custom_id for c in tx(engine, lambda s: claim(s, "w", 3, 30, at(1)))] == ["r0", "r1", "r2"]


def test_a_batch_finished_in_time_completes_even_when_finalized_late(engine: Engine) -> None:
    acme = tenant(engine, "acme")
    batch = new_batch(engine, acme, jsonl(line("a")), now=at(0))
    (a,) = tx(engine, lambda s: claim(s, "w", 1, 30, at(1)))
    assert tx(engine, lambda s: record_result(s, a.id, "w", 200, {}, None, at(2)))
    assert tx(engine, lambda s: finalize_ready(s, batch.expires_at + timedelta(hours=1))) == [batch.id]
    assert tx(engine, lambda s: get_batch(s, acme[0], batch.id)).status == "completed"
