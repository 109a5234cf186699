"""The usage ledger (per tenant, key, model and UTC day) and the limit overrides of tenants and keys.

The gateway records usage on the hot path into memory only (:meth:`UsageRecorder.record`); a
background task writes the sums to ``usage_daily`` every few seconds in one transaction whose
upsert *adds* to the stored rows, so any number of gateway replicas can share the table and no
increment is lost: the database does the additions, row by row, under its own locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import anyio.to_thread
from pydantic import ValidationError
from sqlalchemy import Engine, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from switchyard.policy.tiers import Limits
from switchyard.store.audit import append_event
from switchyard.store.errors import NotFound, StoreError
from switchyard.store.key_changes import announce
from switchyard.store.models import ApiKey, Tenant, UsageCounts, UsageDaily, UsageDailyPublic, UsageReport
from switchyard.store.tenants import get_tenant

log = logging.getLogger("switchyard.usage")

_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "spend")
_ROW_KEY = ("tenant_id", "key_id", "model", "day")
_USAGE_TABLE: Table = UsageDaily.__table__  # type: ignore[attr-defined]

# (tenant_id, key_id, model, UTC day): one row of the ledger.
_Key = tuple[int, int, str, date]


@dataclass(slots=True)
class _Delta:
    """What one ledger row grows by at the next flush."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spend: float = 0.0

    def add(self, other: _Delta) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens
        self.spend += other.spend


class UsageRecorder:
    """Sums usage in memory and adds the sums to the ledger in batches.

    ``record`` never touches the database. ``flush`` writes everything recorded so far in one
    transaction; what is recorded while it runs waits for the next flush, and a flush that fails
    keeps all it took for the next one. ``run`` flushes periodically and ``aclose`` stops it and
    flushes one last time, so a clean shutdown loses nothing.

    A flush whose commit reached the database but whose acknowledgement was lost (the connection
    dropped at that very moment) is retried and so counted twice: the ledger errs towards
    charging, never towards forgetting.

    Args:
        engine: The database (SQLite or PostgreSQL) holding ``usage_daily``.
    """

    def __init__(self, engine: Engine) -> None:
        if engine.dialect.name not in ("sqlite", "postgresql"):
            raise StoreError(f"the usage ledger needs SQLite or PostgreSQL, not {engine.dialect.name}")
        self._engine = engine
        self._pending: dict[_Key, _Delta] = {}
        self._lock = threading.Lock()  # record() may be called from worker threads too
        self._closing = asyncio.Event()
        self._run_done: asyncio.Event | None = None

    def record(self, tenant_id: int, key_id: int, model: str, prompt_tokens: int, completion_tokens: int,
               cached_tokens: int, spend: float, at: datetime | None = None, requests: int = 1) -> None:
        """Count one request (``requests``: 0 for a further part of one already counted: a resumed stream's
        continuation on another engine), in memory.

        Args:
            tenant_id: The tenant's id.
            key_id: The API key's id.
            model: The model that served the request.
            prompt_tokens: Prompt tokens, cached ones included.
            completion_tokens: Generated tokens.
            cached_tokens: Prompt tokens the engine served from its prefix cache.
            spend: What the request cost, in the policy's currency.
            at: When it happened (timezone-aware; default now): picks the UTC day.
        """
        if at is None:
            day = datetime.now(UTC).date()
        elif at.tzinfo is None:
            raise ValueError("usage recorded at a naive datetime: give a timezone-aware one")
        else:
            day = at.astimezone(UTC).date()
        key = (tenant_id, key_id, model, day)
        with self._lock:
            delta = self._pending.get(key)
            if delta is None:
                delta = self._pending[key] = _Delta()
            delta.requests += requests
            delta.prompt_tokens += prompt_tokens
            delta.completion_tokens += completion_tokens
            delta.cached_tokens += cached_tokens
            delta.spend += spend

    @property
    def pending_rows(self) -> int:
        """How many ledger rows the next flush will write."""
        with self._lock:
            return len(self._pending)

    def flush(self) -> int:
        """Add everything recorded so far to the ledger, in one transaction; blocking.

        Returns:
            How many ledger rows were written.

        Raises:
            Whatever the database raised; the deltas are then kept for the next flush.
        """
        with self._lock:
            taken, self._pending = self._pending, {}
        if not taken:
            return 0
        try:
            self._write(taken)
        except BaseException:
            with self._lock:
                for key, delta in taken.items():
                    kept = self._pending.get(key)
                    if kept is None:
                        self._pending[key] = delta
                    else:
                        kept.add(delta)
            raise
        return len(taken)

    def _write(self, deltas: dict[_Key, _Delta]) -> None:
        insert = (postgresql.insert if self._engine.dialect.name == "postgresql" else sqlite.insert)(_USAGE_TABLE)
        upsert = insert.on_conflict_do_update(
            index_elements=list(_ROW_KEY),
            set_={name: _USAGE_TABLE.c[name] + insert.excluded[name] for name in _COUNTS},
        )
        # Rows in one order on every replica: concurrent flushes lock them in that order and
        # wait for one another instead of deadlocking.
        rows = [
            {"tenant_id": t, "key_id": k, "model": m, "day": d, "requests": delta.requests,
             "prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
             "cached_tokens": delta.cached_tokens, "spend": delta.spend}
            for (t, k, m, d), delta in sorted(deltas.items(), key=lambda item: item[0])
        ]
        try:
            with self._engine.begin() as conn:
                conn.execute(upsert, rows)
        except IntegrityError:
            # A key (its tenant) was deleted after these requests: its rows can never be written.
            with self._engine.connect() as conn:
                live = set(conn.execute(select(ApiKey.id).where(col(ApiKey.id).in_({r["key_id"] for r in rows})))
                           .scalars())
            kept = [r for r in rows if r["key_id"] in live]
            if len(kept) == len(rows):
                raise
            log.warning("usage rows of %d deleted keys dropped", len({r["key_id"] for r in rows} - live))
            if kept:
                with self._engine.begin() as conn:
                    conn.execute(upsert, kept)

    async def run(self, interval_s: float) -> None:
        """Flush every ``interval_s`` seconds until :meth:`aclose` (run it as a task).

        The database work runs in a worker thread. A failed flush is logged and its deltas wait
        for the next one.
        """
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self._run_done = done = asyncio.Event()
        try:
            while not self._closing.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), interval_s)
                if self._closing.is_set():
                    break
                try:
                    await anyio.to_thread.run_sync(self.flush)
                except Exception as exc:  # the loop outlives a database outage
                    log.warning("usage flush failed; %d ledger rows kept for the next try: %r",
                                self.pending_rows, exc)
        finally:
            done.set()

    async def aclose(self) -> None:
        """Stop :meth:`run` (after the flush it may be in) and write what is left.

        Raises:
            Whatever the final flush raised: what it could not write is then lost with the process.
        """
        self._closing.set()
        if self._run_done is not None:
            await self._run_done.wait()
        await anyio.to_thread.run_sync(self.flush)


def usage(session: Session, tenant: str | None = None, model: str | None = None,
          since: date | None = None, until: date | None = None) -> UsageReport:
    """Ledger rows (by day, tenant, key and model) and their totals.

    Args:
        session: A session on the database.
        tenant: Only this tenant's rows (by name).
        model: Only this model's rows.
        since: The first UTC day to include.
        until: The last UTC day to include.

    Raises:
        NotFound: There is no tenant called ``tenant``.
    """
    query = select(UsageDaily, Tenant.name).join(Tenant, col(UsageDaily.tenant_id) == col(Tenant.id))
    if tenant is not None:
        query = query.where(UsageDaily.tenant_id == get_tenant(session, tenant).id)
    if model is not None:
        query = query.where(UsageDaily.model == model)
    if since is not None:
        query = query.where(col(UsageDaily.day) >= since)
    if until is not None:
        query = query.where(col(UsageDaily.day) <= until)
    query = query.order_by(col(UsageDaily.day), col(Tenant.name), col(UsageDaily.key_id), col(UsageDaily.model))
    rows = [
        UsageDailyPublic(tenant=name, key_id=row.key_id, model=row.model, day=row.day,
                         **{n: getattr(row, n) for n in _COUNTS})
        for row, name in session.exec(query).all()
    ]
    totals = UsageCounts(**{n: sum(getattr(r, n) for r in rows) for n in _COUNTS})
    return UsageReport(rows=rows, totals=totals)


def set_limits(session: Session, *, tenant: str | None = None, key_id: int | None = None,
               limits: Mapping[str, Any] | None, actor: str, origin: str) -> Limits | None:
    """Set (or, with ``None``, clear) the limit override of one tenant or one key.

    ``limits`` has the shape of a tier's ``limits`` in the policy. A tenant's override replaces
    its tier's limits field by field (a field set to ``None`` lifts that limit); a key's applies
    on top of its tenant's. Fields left out are stored as left out.

    Args:
        session: The session whose transaction carries the change.
        tenant: The tenant, by name (give this or ``key_id``).
        key_id: The API key, by id.
        limits: The override, or ``None`` for none.
        actor: Who changes it (for the audit log, in the same transaction).
        origin: Through what (``cli``, ``api 10.0.0.7``).

    Returns:
        The override as validated.

    Raises:
        StoreError: ``limits`` is not valid; nothing was written.
        NotFound: No such tenant or key.
    """
    if (tenant is None) == (key_id is None):
        raise ValueError("give exactly one of tenant and key_id")
    whose = f"tenant {tenant!r}" if tenant is not None else f"key {key_id}"
    checked = None if limits is None else _checked_limits(limits, whose)
    row: Tenant | ApiKey | None
    if tenant is not None:
        row = get_tenant(session, tenant)
    else:
        row = session.get(ApiKey, key_id)
        if row is None:
            raise NotFound(f"no key with id {key_id}")
    row.limits = None if checked is None else checked.model_dump(exclude_unset=True)
    session.add(row)
    session.flush()
    target = f"tenant:{tenant}" if tenant is not None else f"key:{key_id}"
    append_event(session, actor=actor, origin=origin, action=f"{target.split(':')[0]}.limits", target=target,
                 detail={"limits": row.limits})
    announce(session, f"{target.split(':')[0]}:{row.id}")  # the gateways' key caches hold the overrides
    return checked


def _checked_limits(limits: Mapping[str, Any], whose: str) -> Limits:
    try:
        return Limits.model_validate(limits)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'limits'}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors(include_url=False)
        )
        raise StoreError(f"invalid limits for {whose}: {problems}") from None
