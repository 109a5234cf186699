"""Hot reload: every gateway process follows the active policy version within a second.

Two ways a new version reaches a process, both ending in :meth:`PolicyReloader.activate`, which
compiles it and swaps the one snapshot reference (requests in flight keep the snapshot they
read; endpoint state, connection pools, counters and caches are keyed by name and outlive it):

- **The database** (both ``policy_source`` modes): a publish commits a version and, on
  PostgreSQL, sends ``NOTIFY switchyard_policy``; each process LISTENs and re-reads the active
  version at once. A poll of the active version's number and hash every
  ``policy_poll_interval_s`` is the safety net (a dropped listener connection, SQLite, a
  notification lost between reconnects).
- **The policy file** (``policy_source=file``): the file's folder is watched (editors and
  ConfigMap mounts replace a file by rename or symlink swap, which a watch on the file itself
  would miss) and its identity (inode, size, mtime) is polled as well. A changed file is
  validated and run through its policy tests, recorded as a version (source ``file``; identical
  content is not a new version) and activated; the other processes follow through the database.
  A document with a ``rollout:`` stanza is not activated: it starts a canary with that stanza's slice,
  steps and guardrails (``store.canary.follow_file``), which promotes it or rolls it back.

A document that fails is never activated: the last good version keeps serving, and the error
(each issue with its YAML path and line) is kept for ``/readyz`` and the admin API, logged, and
counted in ``switchyard_policy_reload_failures_total``.

**Key changes** ride on the same PostgreSQL connection (``store/key_changes.py`` has the protocol):
it is named ``switchyard-keys`` (``application_name``) so that whoever revokes a key can count the
processes that must confirm, LISTENs on ``switchyard_keys`` too, and for each notification drops the
key cache's entries and answers on ``switchyard_keys_ack`` before anything else (a policy check
takes milliseconds). On connecting it answers ``*`` and then expires the whole key cache; while it is
down the key cache is not trusted (``KeyAuthenticator.listening``). When no notification comes for
:data:`PROBE_EVERY_S` it runs ``SELECT 1``, so a connection that died quietly is noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import watchfiles
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlmodel import col, select

from switchyard.decide.policy_tests import compile_checked
from switchyard.gateway.auth import KeyAuthenticator
from switchyard.gateway.canary import CanaryFollower
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.model_tokens import ModelTokens, load_model_tokens
from switchyard.gateway.policy_state import PolicyHolder, file_rollout, record_file
from switchyard.gateway.tokenizers import TokenizerCache
from switchyard.policy import PolicyError, PolicySnapshot, policy_sha256, read_policy_file
from switchyard.settings import Settings
from switchyard.store import key_changes
from switchyard.store.db import session_scope
from switchyard.store.key_changes import libpq_url
from switchyard.store.models import PolicyVersion
from switchyard.store.policy_versions import CHANNEL

if TYPE_CHECKING:
    import psycopg

#: While a reload check keeps failing (the database is unreachable), how often it is logged again.
FAILURE_LOG_INTERVAL_S = 30.0

log = logging.getLogger("switchyard.policy")

#: Seconds between attempts to re-open a lost LISTEN connection.
RELISTEN_DELAY_S = 1.0
#: Seconds without a notification after which the LISTEN connection is probed.
PROBE_EVERY_S = 5.0
#: TCP keepalives of the LISTEN connection (a peer that vanished is noticed in about 10 s).
_KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                               "keepalives_count": 3}


@dataclass(frozen=True, slots=True)
class Activation:
    """One switch of the active snapshot (kept for ``/readyz`` and tests of propagation)."""

    version: int | None
    sha256: str
    at: float  # time.time()
    via: str  # notify | poll | file | api | startup


def _file_identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is rewritten or replaced: inode, size, modification time."""
    try:
        st = os.stat(path)  # follows symlinks: a swapped link target is a new identity
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class PolicyReloader:
    """Keeps one process's :class:`PolicyHolder` on the active version (see the module doc)."""

    def __init__(self, settings: Settings, engine: Engine, holder: PolicyHolder, metrics: GatewayMetrics,
                 tokenizers: TokenizerCache, keys: KeyAuthenticator | None = None,
                 canary: CanaryFollower | None = None) -> None:
        self.settings = settings
        self.canary = canary  # the policy canary this process follows (announced on the same channel)
        self.keys = keys  # the key cache that follows key changes on the LISTEN connection
        self.tokenizers = tokenizers
        self.engine = engine
        self.holder = holder
        self.metrics = metrics
        self.activations: list[Activation] = [Activation(holder.snapshot.version, holder.snapshot.sha256,
                                                         time.time(), "startup")]
        self.listening = False
        #: Called with every snapshot made active (what follows the fleet, such as the KV-event subscriptions).
        self.on_swap: list[Callable[[PolicySnapshot], None]] = []
        self._lock = asyncio.Lock()
        self._file_identity = _file_identity(settings.policy_file)
        # The file's content as last read (at start-up, what the holder serves if the file was valid).
        file_mode = settings.policy_source == "file" and holder.last_error is None
        self._file_sha: str | None = holder.snapshot.sha256 if file_mode else None

    # --- activation ----------------------------------------------------------------------------

    def counters_for(self, snapshot: PolicySnapshot) -> ModelTokens:
        """Each model's prompt-token counter (its tokenizer's, else the estimate) and prompt renderer.

        Raises:
            PolicyError: a model's tokenizer or chat template cannot be loaded (the document is rejected).
        """
        return load_model_tokens(snapshot, self.settings.policy_file.resolve().parent, self.tokenizers)

    def _swap(self, snapshot: PolicySnapshot, via: str, tokens: ModelTokens) -> None:
        self.holder.snapshot, self.holder.counters, self.holder.renderers = snapshot, *tokens
        self.metrics.set_policy(snapshot.label, snapshot.sha256, snapshot.version)
        self.activations.append(Activation(snapshot.version, snapshot.sha256, time.time(), via))
        del self.activations[:-100]
        log.info("policy %s (%s) is active (via %s)", snapshot.label, snapshot.sha256[:12], via)
        for listener in self.on_swap:
            listener(snapshot)

    def _failed(self, error: PolicyError, source: str) -> None:
        self.holder.last_error, self.holder.error_source = error, source
        self.metrics.reload_failures.labels(source).inc()
        for issue in error.issues:
            log.error("policy %s rejected: %s", source, issue)
        log.error("still serving policy %s", self.holder.snapshot.label)

    async def check_database(self, via: str = "poll") -> bool:
        """Activate the database's active version if it is not the one serving, and follow the running canary;
        whether the active version switched."""
        try:
            return await self._check_active(via)
        finally:
            if self.canary is not None:
                await self.canary.check()

    async def _check_active(self, via: str) -> bool:
        row = await anyio.to_thread.run_sync(self._active_row)
        current = self.holder.snapshot
        if row is None or (row[0] == current.version and row[1] == current.sha256):
            return False
        async with self._lock:
            current = self.holder.snapshot
            if row[0] == current.version and row[1] == current.sha256:
                return False
            number, _sha, text = await anyio.to_thread.run_sync(self._load_version, row[0])
            try:
                # Compiling and running the policy tests takes tens of milliseconds: off the event loop.
                snapshot = await anyio.to_thread.run_sync(compile_checked, text, f"policy version {number}", number)
                counters = await anyio.to_thread.run_sync(self.counters_for, snapshot)
            except PolicyError as error:
                self._failed(error, "database")
                return False
            self._swap(snapshot, via, counters)
            if self.settings.policy_source == "db":
                self.holder.last_error = None
            return True

    def _active_row(self) -> tuple[int, str] | None:
        with session_scope(self.engine) as session:
            row = session.exec(select(PolicyVersion.number, PolicyVersion.sha256)
                               .where(col(PolicyVersion.active).is_(True))).first()
            return (row[0], row[1]) if row is not None else None

    def _load_version(self, number: int) -> tuple[int, str, str]:
        with session_scope(self.engine) as session:
            row = session.get(PolicyVersion, number)
            if row is None:
                raise LookupError(f"policy version {number} vanished")
            return row.number, row.sha256, row.yaml_text

    async def check_file(self) -> bool:
        """Import the policy file if it changed since it was last read; whether a new version serves."""
        path = self.settings.policy_file
        identity = _file_identity(path)
        if identity == self._file_identity:
            return False
        self._file_identity = identity
        async with self._lock:
            try:
                text = await anyio.to_thread.run_sync(read_policy_file, path)
                if self._file_sha is not None and self._file_sha == policy_sha256(text):
                    return False  # touched, not changed
                snapshot = await anyio.to_thread.run_sync(compile_checked, text, str(path))
                counters = await anyio.to_thread.run_sync(self.counters_for, snapshot)
            except PolicyError as error:
                self._file_sha = None
                self._failed(error, "file")
                return False
            self._file_sha = snapshot.sha256
            self.holder.last_error = None
            if snapshot.sha256 == self.holder.snapshot.sha256:
                return False
            if snapshot.document.rollout is not None:  # it goes live as a canary, not at once
                try:
                    outcome = await anyio.to_thread.run_sync(file_rollout, self.engine, path, snapshot)
                except BaseException:
                    self._file_identity = self._file_sha = None
                    raise
                if outcome != "active":
                    if self.canary is not None:
                        await self.canary.check()
                    return False
            try:
                recorded = await anyio.to_thread.run_sync(record_file, self.engine, path, snapshot,
                                                          "the policy file changed")
            except BaseException:
                # Not recorded (the database is unreachable): read the file again at the next check.
                self._file_identity = self._file_sha = None
                raise
            self._swap(recorded, "file", counters)
            return True

    # --- the loops -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Follow the database (LISTEN and poll) and, in file mode, the file, until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._loop(self.check_database, "database poll"), name="switchyard-policy-poll")
            url = libpq_url(self.settings.resolved_database_url)
            if url is not None:
                tasks.create_task(self._listen(url), name="switchyard-policy-listen")
            if self.settings.policy_source == "file":
                tasks.create_task(self._loop(self.check_file, "file poll"), name="switchyard-policy-file-poll")
                tasks.create_task(self._watch(), name="switchyard-policy-watch")

    async def _loop(self, check: Callable[[], Awaitable[bool]], what: str) -> None:
        interval = self.settings.policy_poll_interval_s
        failing_since: float | None = None
        logged_at = 0.0
        while True:
            await asyncio.sleep(interval)
            try:
                await check()
            except Exception as exc:  # a failed check is logged and retried; the loop must not die
                now = time.monotonic()
                if failing_since is None:
                    failing_since = logged_at = now
                    log.exception("policy reload (%s) failed; still serving policy %s", what,
                                  self.holder.snapshot.label)
                elif now - logged_at >= FAILURE_LOG_INTERVAL_S:  # once in a while, not every poll
                    logged_at = now
                    log.warning("policy reload (%s) still failing after %.0f s (%s); still serving policy %s", what,
                                now - failing_since, exc, self.holder.snapshot.label)
                continue
            if failing_since is not None:
                log.warning("policy reload (%s) works again after %.0f s", what, time.monotonic() - failing_since)
                failing_since = None

    async def _listen(self, url: str) -> None:
        import psycopg  # (PostgreSQL only: a gateway on SQLite never loads it)

        keys = self.keys
        while True:
            try:
                named: dict[str, Any] = {"application_name": key_changes.LISTENER_NAME} if keys is not None else {}
                async with await psycopg.AsyncConnection.connect(url, autocommit=True, connect_timeout=5,
                                                                 **named, **_KEEPALIVES) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    if keys is not None:
                        await conn.execute(f"LISTEN {key_changes.CHANNEL}")
                        # '*' first, then expire: a revoker that hears '*' after its own change knows
                        # this process trusts nothing cached before it.
                        await conn.execute("SELECT pg_notify(%s, %s)", (key_changes.ACK_CHANNEL,
                                                                        key_changes.EVERYTHING))
                        keys.listening(True)
                    self.listening = True
                    await self.check_database("notify")  # anything published while we were not listening
                    await self._follow(conn)
            except (psycopg.Error, OSError, DBAPIError) as exc:
                log.warning("policy LISTEN connection lost (%s); polling until it is back", exc)
            finally:
                self.listening = False
                if keys is not None:
                    keys.listening(False)
            await asyncio.sleep(RELISTEN_DELAY_S)

    async def _follow(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Answer the connection's notifications until it fails: key changes first, then the policy."""
        while True:
            # stop_after ends the generator (releasing the connection) so that acknowledgements can be sent.
            batch = [n async for n in conn.notifies(timeout=PROBE_EVERY_S, stop_after=1)]
            if not batch:
                await conn.execute("SELECT 1")  # a connection that died quietly raises here
                continue
            acks: list[str] = []
            policy = False
            for notice in batch:
                if notice.channel == key_changes.CHANNEL:
                    if self.keys is not None and (ack := self.keys.notice(notice.payload)) is not None:
                        acks.append(ack)
                else:
                    policy = True
            for ack in acks:
                await conn.execute("SELECT pg_notify(%s, %s)", (key_changes.ACK_CHANNEL, ack))
            if policy:
                await self.check_database("notify")

    async def _watch(self) -> None:
        path = self.settings.policy_file.absolute()
        folder = path.parent

        def ours(_change: watchfiles.Change, changed: str) -> bool:
            # The file itself, or anything a ConfigMap-style swap renames in the folder (..data).
            return Path(changed).name == path.name or Path(changed).name.startswith("..")

        while True:
            try:
                async for _changes in watchfiles.awatch(folder, watch_filter=ours, debounce=50, step=20,
                                                        recursive=False):
                    await self.check_file()
            except Exception:  # a folder that vanished, too many watches: the poll still works
                log.exception("watching %s failed; polling it instead", folder)
            await asyncio.sleep(self.settings.policy_poll_interval_s)

    def describe(self) -> dict[str, Any]:
        """For ``/readyz``: how this process follows the policy, and its last switches."""
        return {"listening": self.listening, "poll_interval_s": self.settings.policy_poll_interval_s,
                "activations": [{"version": a.version, "sha256": a.sha256[:12], "at": a.at, "via": a.via}
                                for a in self.activations[-5:]]}


@contextlib.asynccontextmanager
async def following(reloader: PolicyReloader) -> AsyncIterator[PolicyReloader]:
    """Run ``reloader`` for the duration of the block."""
    task = asyncio.create_task(reloader.run(), name="switchyard-policy-reload")
    try:
        yield reloader
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

