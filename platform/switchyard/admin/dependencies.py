"""What the console's pages and the admin API's handlers are given, instead of the gateway's runtime.

A handler names, as parameters, only the pieces it uses, and Litestar injects each by its name
(``NamedDependency``) from the admin routers' ``dependencies`` (:meth:`AdminDependencies.providers`):

- ``settings``: the gateway's :class:`~switchyard.settings.Settings`;
- ``policy``: the policy holder (the active snapshot, its token counters, the last rejected document);
- ``db``: the database engine (:func:`switchyard.admin.common.in_db` runs a transaction on it off the
  event loop);
- ``activity``: this process's recent traffic (:class:`~switchyard.gateway.activity.Activity`);

and, where a page needs one thing more, that thing alone:

- ``endpoints``: the endpoint registry (health, breakers, load) of the overview and ``/admin/api/endpoints``;
- ``engine_caches``: the engines' caches as their KV-cache events report them, and the streams' state;
- ``cache``: the response cache (its backend's figures and purge, its lookup counters);
- ``limits``: the admitter (the tenant page reads its limit store's counters);
- ``change_keys``: a change of what key lookups answer, returned once every gateway process dropped it;
- ``policy_changed``: switches this process to the database's active version after a publish;
- ``replay_limiter``: the console replay's worker slot (one replay at a time in this process).

Guards are given nothing by injection: :func:`~switchyard.admin.common.admin_token_guard` and
:func:`~switchyard.admin.session.console_guard` are made with the one piece each reads.

Owns: the names and types of those dependencies. Must not touch: the gateway's runtime, which the
composition root (:func:`switchyard.app.create_app`) turns into an :class:`AdminDependencies`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

import anyio
from litestar.di import Provide
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.engines.endpoints import EndpointRegistry
from switchyard.gateway.activity import Activity
from switchyard.gateway.admission import Admitter
from switchyard.gateway.policy_state import PolicyHolder
from switchyard.gateway.response_cache import CacheRunner
from switchyard.settings import Settings
from switchyard.state.kvindex import EngineCaches
from switchyard.store.key_changes import Propagation

T = TypeVar("T")


# (runtime_checkable: Litestar checks an injected value against its parameter's type.)
@runtime_checkable
class KeyChanger(Protocol):
    """Runs ``work`` (a revocation, a tenant's deletion or tier change) in one transaction and returns once
    every gateway process dropped what it announced from its key cache (``GatewayRuntime.change_keys``)."""

    async def __call__(self, work: Callable[[Session], T], /) -> tuple[T, Propagation]:
        """The work's result, and how far the change has spread."""
        ...


#: Switches this process to the database's active policy version now; whether it changed.
PolicyChanged = Callable[[], Awaitable[bool]]


def _given(value: object) -> Provide:
    """A dependency that is always ``value``."""
    return Provide(lambda: value, use_cache=True, sync_to_thread=False)


@dataclass(frozen=True, slots=True)
class AdminDependencies:
    """Each piece of the gateway that the console and the admin API use, by itself (see the module doc).

    Attributes:
        settings: The gateway's settings.
        policy: The policy holder, when a request asks for it (it exists once the lifespan started).
        db: The database engine, when a request asks for it (it exists once the lifespan started).
        activity: This process's recent traffic.
        endpoints: The endpoint registry.
        engine_caches: The engines' caches as their KV-cache events report them.
        cache: The response cache.
        limits: The admitter, whose limit store the tenant page reads.
        change_keys: Runs a key change and waits for every gateway process to drop it.
        policy_changed: Switches this process to the database's active policy version.
        replay_limiter: One console replay at a time in this process.
    """

    settings: Settings
    policy: Callable[[], PolicyHolder]
    db: Callable[[], Engine]
    activity: Activity
    endpoints: EndpointRegistry
    engine_caches: EngineCaches
    cache: CacheRunner
    limits: Admitter
    change_keys: KeyChanger
    policy_changed: PolicyChanged
    replay_limiter: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(1))

    def providers(self) -> dict[str, Provide]:
        """The ``dependencies`` of an admin router: each piece under its name."""
        return {
            "settings": _given(self.settings),
            "policy": Provide(self.policy, sync_to_thread=False),
            "db": Provide(self.db, sync_to_thread=False),
            "activity": _given(self.activity),
            "endpoints": _given(self.endpoints),
            "engine_caches": _given(self.engine_caches),
            "cache": _given(self.cache),
            "limits": _given(self.limits),
            "change_keys": _given(self.change_keys),
            "policy_changed": _given(self.policy_changed),
            "replay_limiter": _given(self.replay_limiter),
        }
