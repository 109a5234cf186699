"""The active policy snapshot of this gateway process, and how it is loaded at start-up.

``policy_source=file``: the file is the truth; a valid file is recorded as a version.
``policy_source=db``: the active version in the database is the truth; an empty database is
bootstrapped from the file. Either way an invalid document never replaces a valid one: when the
file is invalid but the database holds a good version, that version serves and the error is
kept (and logged) for operators to see.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import Engine

from switchyard.decide.picking import PromptRenderer
from switchyard.decide.policy_tests import compile_checked
from switchyard.decide.tokens import TokenCounter
from switchyard.policy import PolicyError, PolicySnapshot, read_policy_file
from switchyard.settings import Settings
from switchyard.store.canary import follow_file
from switchyard.store.db import session_scope
from switchyard.store.policy_versions import MAX_AUTHOR, active_version, record_version

log = logging.getLogger("switchyard.policy")


@dataclass(slots=True)
class PolicyHolder:
    """One reference to the active snapshot; a reload swaps it, requests keep what they read.

    ``counters`` (each model's prompt-token counter) and ``renderers`` (each model's prompt renderer, for
    the precise KV-cache scorer) are swapped together with the snapshot, in one step of the event loop, so
    a request that reads them without awaiting in between gets a matching set.
    """

    snapshot: PolicySnapshot
    counters: Mapping[str, TokenCounter] = field(default_factory=dict)
    renderers: Mapping[str, PromptRenderer] = field(default_factory=dict)
    #: The last document rejected since the last good one was read, and where it came from.
    last_error: PolicyError | None = None
    error_source: str = "file"


def _stored(engine: Engine) -> PolicySnapshot | None:
    with session_scope(engine) as session:
        row = active_version(session)
        if row is None:
            return None
        return compile_checked(row.yaml_text, f"policy version {row.number}", row.number)


def file_author(path: Path) -> str:
    """The author of a version imported from ``path``: ``file:<path>``, cut from the left to fit."""
    author = f"file:{path}"
    return author if len(author) <= MAX_AUTHOR else "file:…" + author[-(MAX_AUTHOR - 6):]


def record_file(engine: Engine, path: Path, snapshot: PolicySnapshot, message: str) -> PolicySnapshot:
    """Record a validated document read from ``path`` as a version (unless it is the active one's content)."""
    with session_scope(engine) as session:
        version, created = record_version(session, text=snapshot.text, sha256=snapshot.sha256,
                                          source="file", author=file_author(path), message=message)
    if created:
        log.info("policy %s recorded as version %d", path, version.number)
    return snapshot.with_version(version.number)


def file_rollout(engine: Engine, path: Path, snapshot: PolicySnapshot) -> str:
    """Roll the file's document out as a canary, as its ``rollout:`` stanza says (``store.canary.follow_file``);
    what happened: ``active`` (nothing to roll out: record and activate it as usual), ``running``, ``started`` or
    ``refused``."""
    rollout = snapshot.document.rollout
    assert rollout is not None
    with session_scope(engine) as session:
        outcome, row = follow_file(session, snapshot.text, snapshot.sha256, rollout, author=file_author(path),
                                   document=str(path))
        if outcome == "started" and row is not None:
            log.warning("policy %s goes live as canary %s (version %s) at %g%%", path, row.id, row.version,
                        row.percent)
        elif outcome == "refused" and row is not None:
            log.error("policy %s is not rolled out again: its canary %s ended %s (%s); the active version keeps "
                      "serving until the file changes", path, row.id, row.status, row.reason)
    return outcome


def _from_file(settings: Settings, engine: Engine, message: str) -> PolicySnapshot:
    path = settings.policy_file
    snapshot = compile_checked(read_policy_file(path), str(path))
    if snapshot.document.rollout is not None:
        stored = _stored(engine)
        if stored is not None and stored.sha256 != snapshot.sha256 and file_rollout(engine, path, snapshot) != "active":
            return stored  # the file's document goes live as a canary; the active version serves the rest
    return record_file(engine, path, snapshot, message)


def load_startup_policy(settings: Settings, engine: Engine) -> PolicyHolder:
    """The snapshot to serve at start-up.

    Raises:
        PolicyError: no valid policy exists anywhere (the process must not start).
    """
    if settings.policy_source == "db":
        stored = _stored(engine)
        if stored is not None:
            return PolicyHolder(stored)
        return PolicyHolder(_from_file(settings, engine, "bootstrap of an empty policy store"))
    try:
        return PolicyHolder(_from_file(settings, engine, "loaded at start-up"))
    except PolicyError as error:
        stored = _stored(engine)
        if stored is None:
            raise
        for issue in error.issues:
            log.error("policy file rejected: %s", issue)
        log.error("serving the last good policy, version %s, instead", stored.version)
        return PolicyHolder(stored, last_error=error)
