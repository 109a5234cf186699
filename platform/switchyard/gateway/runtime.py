"""Everything long-lived in a gateway process, created in the app's lifespan and torn down after."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import aiohttp
import anyio.to_thread
from sqlalchemy import Engine
from sqlmodel import Session

from switchyard.engines.breakers import STATE_VALUE, CircuitBreaker, State
from switchyard.engines.endpoints import EndpointRegistry
from switchyard.engines.health import HealthProber, Target
from switchyard.engines.http1 import EngineClient
from switchyard.engines.latency import PoolLatencies
from switchyard.engines.scrape import MetricsScraper
from switchyard.engines.upstream import UpstreamTimeouts, create_client_session, create_engine_client
from switchyard.gateway.activity import Activity, RequestRecord, outcome_of
from switchyard.gateway.adapters import AdapterLoader
from switchyard.gateway.admission import Admitter
from switchyard.gateway.auth import KeyAuthenticator
from switchyard.gateway.canary import CanaryFollower
from switchyard.gateway.classifiers import ClassifierRunner
from switchyard.gateway.flow import FlowController
from switchyard.gateway.kvevents import Exported, Subscriptions, export_metrics, sources_of
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.model_tokens import load_model_tokens
from switchyard.gateway.policy_state import PolicyHolder, load_startup_policy
from switchyard.gateway.reload import PolicyReloader, following
from switchyard.gateway.response_cache import CacheRunner
from switchyard.gateway.retries import RetryBudget
from switchyard.gateway.shutdown import ShutdownSteps
from switchyard.gateway.stalls import StallSampler
from switchyard.gateway.tokenizers import TokenizerCache
from switchyard.gateway.tracing import Tracing
from switchyard.gateway.view import LiveView
from switchyard.gateway.watchdog import Watchdog
from switchyard.settings import Settings
from switchyard.state.memory import Memory
from switchyard.store import db
from switchyard.store.cache import create_response_cache
from switchyard.store.key_changes import Propagation, changing_keys, key_marker, libpq_url
from switchyard.store.keys import KeyIdentity, identify
from switchyard.store.limits import create_limit_store
from switchyard.store.request_log import RequestLogWriter
from switchyard.store.usage import UsageRecorder

#: The period of the event-loop lag probe.
LOOP_LAG_PROBE_S = 0.01
log = logging.getLogger("switchyard.gateway")
#: How often the response cache's entry, byte and eviction gauges are refreshed.
CACHE_GAUGES_INTERVAL_S = 5.0
#: Seconds between copies of the KV-cache event streams' state into the metrics.
KV_GAUGES_INTERVAL_S = 1.0
#: The garbage collector's thresholds in the gateway (Python's default: 700, 10, 10). Measured at saturation (one
#: process on one core, ``switchyard bench --scenario overhead``'s request; the gc-pause metric): with the
#: defaults the collector took 66-89 ms of every second, most of it in full collections, two a second, each
#: walking every record the request log's buffer held. With its records settled (``RequestRecord.settle``) and
#: these thresholds, 7-22 ms: a gen-0 collection every 10-100 ms of 0.2-0.5 ms, a gen-1 of 0.5-4 ms one to eight
#: times a second, a full collection of 10-15 ms every 10-50 s. At 50,000 young objects (tried before the streams
#: stopped being reference cycles) gen-0 pauses reached 100 ms. Since no finished request is a reference cycle
#: (``tests/integration/test_request_garbage.py``), at about 3,150 requests/s: a gen-0 collection every 80 requests
#: (0.24 ms on average), a gen-1 every 850-900 (1.2 ms), no full one in 64,000 requests. At (10000, 10, 100) the
#: collector took half the time, but in gen-0 pauses of 4-5 ms: kept at 2000.
GC_THRESHOLDS = (2000, 10, 100)

T = TypeVar("T")


def gc_timer(metrics: GatewayMetrics) -> Callable[[str, dict[str, Any]], None]:
    """A ``gc.callbacks`` hook that times each collection into ``metrics``' ``switchyard_gc_pause_seconds``."""
    pauses = [metrics.gc_pause.labels(str(g)) for g in range(3)]
    started = 0.0

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        elif started:
            pauses[min(int(info.get("generation", 0)), 2)].observe(time.perf_counter() - started)
            started = 0.0

    return on_gc


class GatewayRuntime:
    """The state a gateway's handlers share; reached through ``app.state.runtime``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        # Scrapes older than three intervals are not trusted as load signals.
        self.endpoints = EndpointRegistry(signal_max_age=3 * settings.scrape_interval_s,
                                          listener=self._breaker_changed)
        self.retry_budget = RetryBudget()
        #: Each pool's observed time to first token (what a hedge at a quantile waits for).
        self.latencies = PoolLatencies()
        #: The tries in flight, watched for deadlines, stalls and hung engines.
        self.watchdog = Watchdog(self.endpoints, self._hung, self._hang_settings, self.engine_urls)
        self.adapters = AdapterLoader(self.endpoints, self.metrics)
        # Shared across replicas through Redis when it is configured, else this process's own.
        self.cache = CacheRunner(create_response_cache(settings.redis_url, f"{settings.redis_key_prefix}cache:"),
                                 lambda: self.classifiers, self.metrics, self.spawn)
        self.flow = FlowController(self.endpoints, self.metrics, settings.flow_control)
        self.started_at = time.time()
        #: What this process did lately (the console's Overview and Requests pages).
        self.activity = Activity(started=self.started_at, log_requests=settings.log_requests)
        self.tracing = Tracing(settings.otlp_traces_endpoint, settings.otel_service_name, settings.region)
        self._engine: Engine | None = None
        self._policy: PolicyHolder | None = None
        self._http: aiohttp.ClientSession | None = None
        self._engines: EngineClient | None = None
        self._classifiers: ClassifierRunner | None = None
        self._reloader: PolicyReloader | None = None
        self._usage: UsageRecorder | None = None
        self.tokenizers = TokenizerCache()
        # Shared across replicas through Redis when it is configured, else this process's own.
        self.admitter = Admitter(create_limit_store(settings.redis_url, key_prefix=f"{settings.redis_key_prefix}lim:"),
                                 lambda mode: self.metrics.dependency_failures.labels("redis", mode).inc())
        self._background: set[asyncio.Task[None]] = set()
        # On PostgreSQL the key cache is trusted only while key changes are heard (gateway/auth.py).
        self.auth = KeyAuthenticator(
            self._lookup_key, settings.key_cache_ttl_s,
            counted=lambda mode: self.metrics.dependency_failures.labels("database", mode).inc(),
            needs_listener=libpq_url(settings.resolved_database_url) is not None)
        self.rotation = 0
        #: The stateful scorers' memory, and the view of the fleet every request's decisions read.
        self.memory = Memory()
        #: The subscriptions to the engines' KV-cache events (inside the lifespan).
        self.kv_events: Subscriptions | None = None
        # (A random source breaks ties between equally scored endpoints.)
        self.view = LiveView(self.endpoints, self.flow, self.memory, self.next_rotation, random.Random(),
                             self.latencies)
        #: The policy canary this process follows, if one runs.
        self.canary = CanaryFollower(lambda: self.engine, lambda snapshot: self.reloader.counters_for(snapshot),
                                     self.view, self.metrics)

    @property
    def engine(self) -> Engine:
        """The database engine (only inside the lifespan)."""
        if self._engine is None:
            raise RuntimeError("the gateway is not started")
        return self._engine

    @property
    def policy(self) -> PolicyHolder:
        """The active policy holder (only inside the lifespan)."""
        if self._policy is None:
            raise RuntimeError("the gateway is not started")
        return self._policy

    @property
    def reloader(self) -> PolicyReloader:
        """What keeps the policy current (only inside the lifespan)."""
        if self._reloader is None:
            raise RuntimeError("the gateway is not started")
        return self._reloader

    async def policy_changed(self) -> bool:
        """Switch to the database's active version now (after a publish through this process).

        The other processes follow by NOTIFY or their poll; this one need not wait for either.
        """
        return await self.reloader.check_database("api")

    async def change_keys(self, work: Callable[[Session], T]) -> tuple[T, Propagation]:
        """Run ``work`` (a revocation, a tenant's deletion or tier change) in one transaction and return once
        every gateway process dropped what it announced (``store/key_changes.py``); this process's own
        entries go right after the commit."""
        loop = asyncio.get_running_loop()

        def committed(targets: tuple[str, ...]) -> None:
            loop.call_soon_threadsafe(self.auth.forget, targets)

        result, propagation = await anyio.to_thread.run_sync(partial(changing_keys, self.engine, work,
                                                                     committed=committed))
        self.auth.forget(propagation.targets)  # in case the scheduled drop has not run yet
        return result, propagation

    @property
    def usage(self) -> UsageRecorder:
        """The usage ledger's writer (only inside the lifespan)."""
        if self._usage is None:
            raise RuntimeError("the gateway is not started")
        return self._usage

    def finished(self, record: RequestRecord, model: str, pool: str, status: int) -> None:
        """A request was answered with ``status``: count it (``switchyard_requests{model, pool, status}``)
        and keep its record."""
        outcome = outcome_of(status, shed=record.shed, broken=record.broken)
        self.metrics.requests_by(model, pool, str(status), record.tier or "-", record.priority or "-",
                                     record.region or "-", outcome).inc()
        self.activity.finish(record, status)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, kept referenced until it ends (settling a finished stream)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def http(self) -> aiohttp.ClientSession:
        """The upstream connection pool (only inside the lifespan)."""
        if self._http is None:
            raise RuntimeError("the gateway is not started")
        return self._http

    @property
    def engines(self) -> EngineClient:
        """The client of requests to engines: completions, streams, adapter loads (only inside the lifespan)."""
        if self._engines is None:
            raise RuntimeError("the gateway is not started")
        return self._engines

    @property
    def classifiers(self) -> ClassifierRunner:
        """The embedding classifiers' runner (only inside the lifespan)."""
        if self._classifiers is None:
            raise RuntimeError("the gateway is not started")
        return self._classifiers

    def next_rotation(self) -> int:
        """A counter for the round-robin picker."""
        self.rotation += 1
        return self.rotation

    def engine_urls(self) -> list[str]:
        """Every endpoint of the active policy."""
        return [url for pool in self.policy.snapshot.pools.values() for url in pool.endpoints]

    def probed_urls(self) -> list[str]:
        """Every endpoint of the active policy, whose resilience parameters the registry takes on now."""
        snapshot = self.policy.snapshot
        self.endpoints.configure(snapshot.document.resilience)
        return [url for pool in snapshot.pools.values() for url in pool.endpoints]

    def trial_targets(self) -> list[Target]:
        """The endpoints of the active policy's pools (where breaker trials may go)."""
        return [Target(url, pool.name, pool.served_model, pool.task) for pool in self.policy.snapshot.pools.values()
                for url in pool.endpoints]

    def mark_down(self, url: str, reason: str) -> None:
        """Take ``url`` out of service after a refused connection (until its probes succeed)."""
        if self.endpoints.mark_down(url, reason):
            self._health_changed(url, False, reason)

    def _health_changed(self, url: str, up: bool, reason: str | None) -> None:
        pools = self.policy.snapshot.pools.values() if self._policy is not None else ()
        pool = next((p.name for p in pools if url in p.endpoints), "-")
        self.metrics.endpoint_up.labels(pool, url).set(1 if up else 0)
        if up:
            log.warning("endpoint %s is back in service (health probes succeeded)", url)
        else:
            log.warning("endpoint %s is out of service: %s", url, reason)

    def _hang_settings(self) -> tuple[bool, float]:
        spec = self.policy.snapshot.document.resilience.hang_detection
        return spec.enabled, spec.after

    def _hung(self, url: str, why: str) -> None:
        pools = self.policy.snapshot.pools.values() if self._policy is not None else ()
        pool = next((p.name for p in pools if url in p.endpoints), "-")
        self.metrics.hangs.labels(pool, url).inc()

    def _breaker_changed(self, breaker: CircuitBreaker, state: State, reason: str) -> None:
        self.metrics.breaker_state.labels(breaker.scope, breaker.name).set(STATE_VALUE[state])
        self.metrics.breaker_transitions.labels(breaker.scope, breaker.name, state).inc()
        log.warning("%s breaker %s is %s: %s", breaker.scope, breaker.name, state.replace("_", "-"), reason)

    async def _kv_gauges(self) -> None:
        """Copy the KV-cache event streams' state into their metrics every second (a few dozen numbers)."""
        exported = Exported()
        while True:
            if self.kv_events is not None:
                export_metrics(self.kv_events, self.metrics, exported, time.monotonic())
            await asyncio.sleep(KV_GAUGES_INTERVAL_S)

    async def _cache_gauges(self) -> None:
        """Copy the response cache's counts into its gauges every few seconds."""
        while True:
            try:
                await self.cache.refresh_gauges()
            except Exception as exc:  # Redis unreachable: the gauges keep their last values
                log.debug("response cache stats unavailable: %s", exc)
            await asyncio.sleep(CACHE_GAUGES_INTERVAL_S)

    async def _watch_loop_lag(self) -> None:
        """Time a 10 ms timer, forever: how late it fires is the event loop's lag (a metric)."""
        loop = asyncio.get_running_loop()
        observe = self.metrics.loop_lag.observe
        threshold = self.settings.stall_sampler_ms
        sampler = StallSampler(threshold / 1000, LOOP_LAG_PROBE_S) if threshold else None
        if sampler is not None:
            sampler.start()
        try:
            while True:
                due = loop.time() + LOOP_LAG_PROBE_S
                await asyncio.sleep(LOOP_LAG_PROBE_S)
                observe(max(0.0, loop.time() - due))
                if sampler is not None:
                    sampler.beat()
        finally:
            if sampler is not None:
                sampler.stop()

    def _lookup_key(self, key_hash: str) -> KeyIdentity | None:
        with db.session_scope(self.engine) as session:
            return identify(session, key_hash)

    def prepare(self) -> None:
        """Open the database (migrating it if behind) and load the policy; idempotent.

        ``switchyard serve`` calls this before the server starts so that a missing database or
        an invalid policy is reported plainly; the lifespan calls it otherwise.

        Raises:
            PolicyError: no valid policy exists anywhere.
            sqlalchemy.exc.OperationalError: the database cannot be reached.
        """
        if self._engine is not None:
            return
        engine = db.create_db_engine(self.settings.resolved_database_url)
        try:
            if not db.is_current(engine):
                log.info("upgrading the database schema to %s", db.SCHEMA_HEAD)
                db.upgrade(engine)
            holder = load_startup_policy(self.settings, engine)
            holder.counters, holder.renderers = load_model_tokens(
                holder.snapshot, self.settings.policy_file.resolve().parent, self.tokenizers)
        except BaseException:
            engine.dispose()
            raise
        self._engine, self._policy = engine, holder

    @asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        """Open the database, load the policy, open the upstream pool; close them at the end."""
        await anyio.to_thread.run_sync(self.prepare)
        snapshot = self.policy.snapshot
        self.metrics.set_policy(snapshot.label, snapshot.sha256, snapshot.version)
        self._reloader = PolicyReloader(self.settings, self.engine, self.policy, self.metrics, self.tokenizers,
                                        keys=self.auth, canary=self.canary)
        await self.canary.check()  # a canary that runs already (this replica restarted in the middle of it)
        self.activity.canary_sink = self.canary.observe
        # Every endpoint's KV-cache events, followed off the request path; the fleet's changes follow reloads.
        kv_events = self.kv_events = Subscriptions(self.memory.engine_caches)
        kv_events.update(sources_of(snapshot))
        self._reloader.on_swap.append(lambda active: kv_events.update(sources_of(active)))
        marker = key_marker(self.settings.resolved_database_url)  # SQLite: key changes by other processes
        if marker is not None:
            self.auth.follow_marker(marker.read)
        self._usage = UsageRecorder(self.engine)
        timeouts = UpstreamTimeouts(self.settings.upstream_connect_timeout_s, self.settings.upstream_read_timeout_s)
        self._http = create_client_session(timeouts, self.settings.upstream_max_connections)
        self._engines = create_engine_client(timeouts, self.settings.upstream_max_connections)
        self._classifiers = ClassifierRunner(self._http, self.endpoints, self.metrics)
        # Objects made during start-up live as long as the process: keep them out of the collector's way.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        gc_hook = gc_timer(self.metrics)
        gc.callbacks.append(gc_hook)
        log.info("gateway ready on %s with policy %s (%s)", self.settings.listen, snapshot.label,
                 self.settings.policy_source)
        scraper = MetricsScraper(self.endpoints, self._http, self.engine_urls, self.settings.scrape_interval_s,
                                 self.mark_down)
        scraping = asyncio.create_task(scraper.run(), name="switchyard-scrape")
        prober = HealthProber(self.endpoints, self._http, self.probed_urls, self._health_changed, self.trial_targets)
        probing = asyncio.create_task(prober.run(), name="switchyard-health")
        ledger = asyncio.create_task(self._usage.run(self.settings.usage_flush_interval_s), name="switchyard-usage")
        settings = self.settings
        request_log: RequestLogWriter | None = None
        logging_task: asyncio.Task[None] | None = None
        if settings.request_log:
            request_log = RequestLogWriter(self.engine, sample_rate=settings.request_log_sample_rate,
                                           retention_days=settings.request_log_retention_days)
            self.activity.sink = request_log.offer
            writer = request_log
            self.metrics.request_log_pending.set_function(lambda: writer.pending)
            self.metrics.request_log_dropped.set_function(lambda: writer.dropped)
            logging_task = asyncio.create_task(request_log.run(settings.request_log_flush_interval_s),
                                               name="switchyard-request-log")
        pumping = asyncio.create_task(self.flow.run(), name="switchyard-flow")
        watching = asyncio.create_task(self.watchdog.run(), name="switchyard-watchdog")
        gauges = asyncio.create_task(self._cache_gauges(), name="switchyard-cache-gauges")
        kv_gauges = asyncio.create_task(self._kv_gauges(), name="switchyard-kv-gauges")
        lag = asyncio.create_task(self._watch_loop_lag(), name="switchyard-loop-lag")
        canary_task = asyncio.create_task(self.canary.run(), name="switchyard-canary")
        try:
            async with following(self._reloader):
                yield
        finally:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(gc_hook)
            with ShutdownSteps("shutdown") as steps:
                steps.at("stopping the background tasks")
                for task in (scraping, probing, pumping, watching, gauges, kv_gauges, lag, canary_task):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                steps.at("closing the KV-cache event subscriptions")
                await kv_events.close()
                if self._background:  # streams that ended during shutdown settle before the store closes
                    steps.at(f"settling {len(self._background)} finished requests")
                    await asyncio.wait(self._background, timeout=5)
                steps.at("writing the usage ledger")
                ledger.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ledger
                await self._usage.aclose()  # nothing recorded is lost on a clean shutdown
                if request_log is not None and logging_task is not None:
                    steps.at(f"writing the request log's last {request_log.pending} rows")
                    logging_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await logging_task
                    self.activity.sink = None
                    await request_log.aclose()
                steps.at("closing the limit store and the response cache")
                await self.admitter.store.aclose()
                await self.cache.cache.aclose()
                steps.at("closing the engines' connections")
                self._classifiers.close()
                self._classifiers = None
                await self._http.close()
                self._http = None
                await self._engines.close()
                self._engines = None
                steps.at("sending the last trace spans")
                await anyio.to_thread.run_sync(self.tracing.shutdown)  # the last spans go out
                steps.at("closing the database")
                if marker is not None:
                    marker.close()
                self.engine.dispose()
