"""The engine loop: runs the synchronous core against the wall clock.

Simulated time maps to wall time by one fixed anchor: ``sim = (wall - wall0) * time_scale``.
Each step's outputs are released when the wall clock reaches the simulated end of that step,
so timer granularity and scheduling jitter never accumulate into drift. When the loop falls
behind (many streams, a high ``time_scale``), it computes every step up to "now" in one go
and delivers their tokens together: each stream then gets one write with all its queued
chunks, the per-token cost drops, and the engine catches up instead of falling further
behind. Simulated timings (and so the metrics) are the same either way; only the wall-clock
granularity of delivery coarsens while the process is saturated.

While nothing is queued the loop waits on an event (no polling); a request arriving then
jumps the idle clock forward to "now".

The stalling fault modes (``faults.py``) are applied here, between steps: in ``hang`` the loop
computes no step and holds the tokens of the step in flight until the mode changes; in ``drip`` it
computes one step at a time, at most one per ``drip_interval_s``. When a stall ends, the core's clock
jumps to "now" (``EngineCore.advance_to``): the stalled wall-clock time is time the engine spent
doing nothing, not steps to catch up on, and the latencies vLLM would measure across it include it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from typing import Any, Protocol

from switchyard.kvcache.publisher import Publisher, open_publisher
from switchyard.sim.config import ResolvedConfig
from switchyard.sim.core import EngineCore
from switchyard.sim.faults import FaultState
from switchyard.sim.lora import LoraAdapter, LoraRegistry, LoraRequestError, check_adapter_path
from switchyard.sim.request import SimRequest, Status
from switchyard.sim.responses import system_fingerprint

#: Most steps computed between two deliveries when catching up (bounds the loop's latency).
MAX_STEPS_PER_WAKE = 2048
#: Trace contexts kept for ``/sim/state``.
TRACE_CONTEXTS = 32


class Waker:
    """A one-slot wake-up signal shared by the channels of one HTTP request."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: asyncio.Future[None] | None = None

    def wake(self) -> None:
        """Wake the waiter, if any (a no-op otherwise)."""
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    async def wait(self) -> None:
        """Sleep until the next ``wake``."""
        self._future = asyncio.get_running_loop().create_future()
        try:
            await self._future
        finally:
            self._future = None


class Channel:
    """What an HTTP handler may see of one request: tokens whose step has elapsed.

    The core appends a token when it *computes* a step; the channel only shows it once the
    step's simulated duration has passed on the wall clock.
    """

    __slots__ = ("finished", "request", "visible", "waker")

    def __init__(self, request: SimRequest, waker: Waker) -> None:
        self.request = request
        self.waker = waker
        self.visible = 0
        self.finished = False

    def publish(self, request: SimRequest) -> None:
        """Make the request's progress visible and wake its handler."""
        self.visible = len(request.output)
        self.finished = request.status is Status.FINISHED
        self.waker.wake()

    @property
    def aborted(self) -> bool:
        """Whether the request was aborted (client gone, or engine stopping)."""
        return self.request.finish_reason == "abort"


class Listener(Protocol):
    """The engine's listening socket, as the server running the app gives it (fault mode ``down``)."""

    @property
    def listening(self) -> bool:
        """Whether connections are accepted."""

    def close(self) -> None:
        """Stop accepting connections and drop the open ones."""

    async def reopen(self) -> None:
        """Listen again on the same address.

        Raises:
            OSError: The address cannot be bound again.
        """


class EngineRuntime:
    """One simulated engine: core, fault state and the asyncio task that drives them.

    Args:
        config: The resolved engine configuration.
    """

    def __init__(self, config: ResolvedConfig) -> None:
        self.config = config
        self.core = EngineCore(
            config.profile, kv_cache_tokens=config.kv_cache_tokens,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, lora=config.lora)
        #: The adapters requests may name (None without ``--enable-lora`` or runtime updating).
        self.loras: LoraRegistry | None = None
        if config.lora is not None or config.allow_runtime_lora:
            self.loras = LoraRegistry(config.served_model, config.lora.modules if config.lora else ())
            if self.core.lora is not None:
                for adapter in self.loras.adapters.values():
                    self.core.lora.preload(adapter)
        self.faults = FaultState(config.seed)
        #: The W3C ``traceparent`` of the last requests that sent one, with their ``x-request-id``
        #: (vLLM continues such a trace in its own spans when it exports any).
        self.trace_contexts: deque[dict[str, str | None]] = deque(maxlen=TRACE_CONTEXTS)
        #: Set by the server that runs the app; None in process (``down`` then answers 503).
        self.listener: Listener | None = None
        self._listener_lock = asyncio.Lock()
        #: ``system_fingerprint`` of every response: stable for one engine setup.
        self.fingerprint = system_fingerprint(config.served_model, config.profile.name,
                                              config.max_model_len, config.kv_cache_tokens,
                                              config.max_num_seqs)
        self.scale = config.time_scale
        self.lag_s = 0.0
        #: Wall-clock seconds the engine loop spent stalled (fault modes ``hang`` and ``drip``).
        self.stalled_s = 0.0
        self._wall0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._live: set[SimRequest] = set()
        #: Publishes the core's KV-cache events (``--kv-events-config``); None when it does not.
        self.kv_publisher: Publisher | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine loop on the running event loop (and the KV event publisher, if configured).

        Raises:
            ValueError: The KV event endpoints cannot be set up.
        """
        self.open_kv_publisher()
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._wall0 = loop.time()
        self._task = loop.create_task(self._run(), name=f"sim-engine-{self.config.port}")

    def open_kv_publisher(self) -> None:
        """Set up the KV event publisher now, if configured and not yet open.

        Raises:
            ValueError: The endpoints cannot be set up (the message names them).
        """
        if self.kv_publisher is None:
            publisher = open_publisher(self.config.kv_events)
            if publisher is not None:
                self.kv_publisher = publisher
                self.core.enable_kv_events(publisher.publish)

    def close_kv_publisher(self) -> None:
        """Stop publishing (what is queued still goes out, for up to a second)."""
        publisher, self.kv_publisher = self.kv_publisher, None
        if publisher is not None:
            self.core.kv_sink = None
            publisher.close()

    async def stop(self) -> None:
        """Stop the loop and abort whatever is still in flight."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in list(self._live):
            self.abort(req)
        if self.kv_publisher is not None:
            await asyncio.to_thread(self.close_kv_publisher)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``POST /reset_prefix_cache``: see ``EngineCore.reset_prefix_cache``."""
        reset = self.core.reset_prefix_cache(reset_running_requests)
        if reset_running_requests:
            self._wake.set()  # the preempted requests run again
        return reset

    @property
    def in_flight(self) -> int:
        """Requests accepted and not yet finished or aborted."""
        return len(self._live)

    @property
    def listening(self) -> bool:
        """Whether the engine accepts connections (always, without a listener)."""
        return self.listener is None or self.listener.listening

    async def sync_listener(self) -> None:
        """Close the listener in fault mode ``down``, open it again in any other mode.

        Raises:
            OSError: The address could not be bound again; the mode is set back to ``down``.
        """
        async with self._listener_lock:
            listener = self.listener
            if listener is None:
                return
            down = self.faults.mode == "down"
            if down and listener.listening:
                listener.close()
            elif not down and not listener.listening:
                try:
                    await listener.reopen()
                except OSError:
                    self.faults.apply({"mode": "down"})
                    raise

    # --- clock -------------------------------------------------------------------------------

    def sim_to_epoch(self, t: float) -> float:
        """The Unix time of simulated time ``t`` (never later than now: a step computed ahead of the wall
        clock is reported as happening now)."""
        now = time.time()
        if self._loop is None:
            return now
        return now - max(0.0, self.wall_to_sim() - t) / self.scale

    def _loop_or_fail(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the engine is not started")
        return self._loop

    def wall_to_sim(self) -> float:
        """The anchored simulated time of this wall-clock instant."""
        return (self._loop_or_fail().time() - self._wall0) * self.scale

    def clock(self) -> float:
        """Simulated "now" for an event arriving from outside the loop (an arrival).

        This is the anchored time, also when the core is lagging behind it (the arrival then
        waits in the core's pending queue until the catch-up steps reach it) or ahead of it
        (a step in flight: the arrival joins the queue when that step ends).
        """
        t = self.wall_to_sim()
        if not self.core.has_work():
            self.core.advance_to(t)
        return t

    # --- requests ----------------------------------------------------------------------------

    def submit(self, req: SimRequest, channel: Channel) -> None:
        """Accept a request now; the core adds the profile's frontend overhead."""
        req.arrival = self.clock()
        req.sink = channel
        self._live.add(req)
        self.core.add_request(req)
        self._wake.set()

    def adapter(self, model: object) -> LoraAdapter | None:
        """The adapter a request's ``model`` names, None for the base model or a name not registered."""
        return None if self.loras is None else self.loras.get(model)

    def served_name(self, adapter: LoraAdapter | None) -> str:
        """The name a request is answered under: its adapter's, else the served model's."""
        return self.config.served_model if adapter is None else adapter.name

    def note_trace(self, headers: dict[bytes, bytes], request_id: str | None) -> None:
        """Keep a request's ``traceparent`` (for ``/sim/state``), when it carries one."""
        traceparent = headers.get(b"traceparent")
        if traceparent is not None:
            self.trace_contexts.append({"request_id": request_id, "traceparent": traceparent.decode("latin-1")})

    def unknown_model(self) -> None:
        """A request named a model that is neither the base model nor an adapter (answered 404): with
        runtime updating vLLM first tries its LoRA resolvers, which spends an adapter id."""
        if self.loras is not None and self.config.allow_runtime_lora:
            self.loras.spend_id()

    def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> float:
        """``POST /v1/load_lora_adapter``: register the adapter and have the engine load it.

        ``path`` is read only when it is on this machine (``lora.check_adapter_path``): a path that does not
        exist here and is in no directory that does (``/adapters/support-v1``, a Hugging Face id) is a
        simulated adapter and loads; one that exists, or would be in a directory that exists, must hold an
        adapter, else vLLM's 404 "No adapter found for <path>" (its 500 for a file or a broken config), and
        nothing is registered (an id is spent, as in vLLM).

        Returns:
            Simulated time the engine has it loaded (when vLLM answers).

        Raises:
            LoraRequestError: vLLM's refusal (a 400; a 404 or 500 when the engine cannot load it; a 500
                when LoRA is not enabled).
        """
        registry = self.loras
        lora = self.core.lora
        if registry is None:  # not served then: the routes exist only with runtime updating
            raise LoraRequestError(404, "Not Found", "NotFoundError")
        registry.check_load(name, path, load_inplace=load_inplace)
        if lora is None:  # runtime updating without --enable-lora: the worker's add_lora fails
            if registry.get(name) is None:
                registry.spend_id()
            raise LoraRequestError(500, "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora "
                                   "to enable LoRA.", "InternalServerError")
        try:
            check_adapter_path(name, path)
        except LoraRequestError:
            if registry.get(name) is None:
                registry.spend_id()
            raise
        adapter = registry.load(name, path, load_inplace=load_inplace)
        done = lora.add_lora(adapter, self.clock(), self.core.has_work(), reload=load_inplace)
        self._wake.set()
        return done

    def unload_adapter(self, name: str) -> None:
        """``POST /v1/unload_lora_adapter``: forget the name (the engine keeps the weights cached).

        Raises:
            LoraRequestError: vLLM's 400 (no name) or 404 (not loaded).
        """
        if self.loras is None:
            raise LoraRequestError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self.loras.unload(name)

    async def sleep_until(self, t: float) -> None:
        """Wait until the anchored simulated clock reaches ``t``."""
        delay = (t - self.wall_to_sim()) / self.scale
        if delay > 0:
            await asyncio.sleep(delay)

    def abort(self, req: SimRequest) -> None:
        """Abort a request (frees its KV blocks) and wake its handler."""
        self._live.discard(req)
        if req.status is not Status.FINISHED:
            self.core.abort(req)
        if req.sink is not None:
            req.sink.publish(req)

    # --- the loop ----------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = self._loop_or_fail()
        core = self.core
        faults = self.faults
        live = self._live
        last_step = -math.inf  # loop time of the last step computed (drip spaces them out)
        while True:
            if not core.has_work():
                self._wake.clear()
                # The idle clock was moved to the arrival by ``clock()``; the loop's own
                # wake-up latency must not be charged to the request.
                await self._wake.wait()
                continue
            if faults.hung:
                await self._stall(None)
                continue
            dripping = faults.mode == "drip"
            if dripping and loop.time() < last_step + faults.drip_interval_s:
                await self._stall(last_step + faults.drip_interval_s)
                continue
            core.slow_factor = faults.step_factor
            # One step when on time; every step up to "now" when behind (one delivery each). A drip
            # makes exactly one: the wall clock it spent stalled was skipped, not owed.
            now = self.wall_to_sim()
            self.lag_s = max(0.0, now - core.now)
            emitted = core.step().emitted if dripping else core.advance(until=now, max_steps=MAX_STEPS_PER_WAKE)
            last_step = loop.time()
            delay = self._wall0 + core.now / self.scale - loop.time()
            await asyncio.sleep(max(delay, 0.0))  # sleep(0) still lets handlers run
            while faults.hung:  # hung while the step ran: its outputs wait for the engine to resume
                await self._stall(None)
            for req in emitted:
                if req.status is Status.FINISHED:
                    live.discard(req)
                sink = req.sink
                if sink is not None:
                    sink.publish(req)

    async def _stall(self, until: float | None) -> None:
        """Let wall-clock time pass without a step, until loop time ``until`` (None: no limit) or the next
        fault settings change, whichever comes first; then jump the core's clock over the stall."""
        loop = self._loop_or_fail()
        started = loop.time()
        change = asyncio.ensure_future(self.faults.wait_changed())
        try:
            await asyncio.wait({change}, timeout=None if until is None else max(0.0, until - started))
        finally:
            change.cancel()
        self.stalled_s += loop.time() - started
        self.core.advance_to(self.wall_to_sim())

    def snapshot(self) -> dict[str, Any]:
        """Engine internals for ``/sim/state``."""
        core, kv = self.core, self.core.kv
        cfg = self.config
        return {
            "clock_s": core.now,
            "steps": core.steps,
            "busy_s": core.busy_seconds,
            "used_s": core.used_seconds,
            "running": len(core.running),
            "waiting": core.num_waiting,
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_used": kv.num_used,
            "kv_blocks_cached": kv.num_cached,
            "kv_blocks_free": kv.num_free,
            "kv_cache_usage": kv.usage,
            "kv_evictions": kv.evictions,
            "block_size": core.block_size,
            "preemptions": core.stats.preemptions,
            "aborted": core.stats.aborted,
            "prefix_cache_queries": core.stats.prefix_queries,
            "prefix_cache_hits": core.stats.prefix_hits,
            "slow_factor": core.slow_factor,
            "model": cfg.served_model,
            "profile": cfg.profile.name,
            "time_scale": self.scale,
            "lag_s": self.lag_s,
            "stalled_s": self.stalled_s,
            "in_flight": self.in_flight,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_model_len": cfg.max_model_len,
            "kv_cache_tokens": cfg.kv_cache_tokens,
            "faults": self.faults.as_dict(),
            "faulted": dict(self.faults.counts),
            "listening": self.listening,
            "trace_contexts": list(self.trace_contexts),
            "kv_events": self._kv_events_state(),
            "lora": self._lora_state(),
        }

    def _lora_state(self) -> dict[str, Any] | None:
        registry, lora = self.loras, self.core.lora
        if registry is None and lora is None:
            return None
        state: dict[str, Any] = {"enabled": lora is not None, "runtime_updating": self.config.allow_runtime_lora}
        if registry is not None:
            state["registered"] = [{"name": a.name, "id": a.int_id, "path": a.path}
                                   for a in registry.adapters.values()]
        if lora is not None:
            state.update(lora.snapshot())
        return state

    def _kv_events_state(self) -> dict[str, Any] | None:
        pub = self.kv_publisher
        if pub is None:
            return None
        return {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": pub.config.topic,
                "batches_sent": pub.sent, "batches_dropped": pub.dropped}
