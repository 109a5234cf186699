"""The engine core: vLLM v1's scheduler over a paged KV cache, as plain synchronous code.

``EngineCore.step()`` does what one iteration of vLLM's engine loop does — schedule, run the
forward pass, sample — except that the forward pass is replaced by the hardware profile's
cost model: it returns what happened and how many simulated seconds it took, and advances the
core's clock by that much. Nothing here sleeps or touches asyncio, so every scheduling rule is
unit-testable step by step; ``runtime.py`` turns steps into wall-clock time.

Scheduling follows vLLM v1 with chunked prefill and ``--scheduling-policy priority``:

1. Running requests first, in order: each asks for its remaining tokens (a whole prefill
   chunk, or one decode token), capped by the step's token budget. If its KV blocks cannot
   grow, the lowest-priority, latest-arrived running request is preempted (recompute mode:
   its blocks are freed and it goes back to the waiting queue) until it fits, or until it is
   itself the one preempted.
2. If nobody was preempted, waiting requests in (priority, arrival) order: each reuses its
   longest cached prefix (whole blocks, never its last token), and is admitted if the
   blocks for its first chunk are free and fewer than ``max_num_seqs`` are running. The
   first one that does not fit stops admission (no overtaking), as in vLLM.

With LoRA enabled (``lora``), step 2 also keeps a batch to ``max_loras`` distinct adapters, as vLLM's
scheduler does: the adapters of the running requests scheduled in step 1 count, then each admitted
request adds its own. A waiting request whose adapter is not among them once there are ``max_loras`` is
*skipped* — set aside for this step (vLLM's ``deferred_waiting``, the ``deferred`` waiting reason) while
the requests after it may still be admitted; the skipped go back to the queue in their order at the end
of the step. Base-model requests are never skipped. Every adapter of a step's batch is then made
resident in the engine's GPU slots (loading or copying it costs time in that step: ``lora.py``).

KV-cache events (``enable_kv_events``): the block pool records evictions and resets, and
``register_full_blocks`` one ``BlockStored`` per request and step for the blocks that became
full; at the end of each step that recorded any, they go to the sink as one batch, as vLLM's
scheduler publishes one ``KVEventBatch`` per step. Within a step, evictions come before stores
(vLLM interleaves them request by request); a reset's ``AllBlocksCleared`` goes out with the next
step, as in vLLM, where the reset is queued between steps.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from switchyard.kvcache.wire import MEDIUM_GPU, BlockStored, Event
from switchyard.sim.fastpath import run_decodes
from switchyard.sim.kv import HASH_MASK, BlockPool
from switchyard.sim.lora import LoraCosts, LoraEngine, LoraSettings
from switchyard.sim.profiles import EngineProfile
from switchyard.sim.request import SimRequest, Status
from switchyard.sim.stats import EngineStats


@dataclass(slots=True)
class StepResult:
    """What one engine step did.

    Attributes:
        start: Simulated time the step started.
        duration: Simulated seconds it took.
        scheduled: Requests computed this step.
        prefill_tokens: Prompt (or recomputed) tokens computed.
        decode_tokens: Decode tokens computed (one per decoding sequence).
        emitted: Requests that produced a token (including those that finished).
        finished: Requests that reached their output length.
        preempted: Requests preempted to make room.
    """

    start: float
    duration: float
    scheduled: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    emitted: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)

    @property
    def end(self) -> float:
        """Simulated time the step's outputs become visible."""
        return self.start + self.duration


def _victim_key(req: SimRequest) -> tuple[int, float, int]:
    return (req.priority, req.arrival, req.seq)


_Entry = tuple[int, float, int, SimRequest]


def _heap_order(heap: list[_Entry]) -> Iterator[SimRequest]:
    """The requests of a heap in pop order, without popping (O(k log k) for the first k)."""
    if not heap:
        return
    frontier = [(heap[0], 0)]
    size = len(heap)
    while frontier:
        entry, i = heapq.heappop(frontier)
        yield entry[3]
        for child in (2 * i + 1, 2 * i + 2):
            if child < size:
                heapq.heappush(frontier, (heap[child], child))


class EngineCore:
    """Scheduler, KV cache and clock of one simulated engine.

    Args:
        profile: Cost model and block size.
        kv_cache_tokens: KV capacity in tokens (rounded down to whole blocks).
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Token budget of one step.
        max_model_len: Context window (for the token-count histograms).
        frontend_overhead_s: Simulated delay between a request's arrival at the server and
            its arrival at the scheduler; None for the profile's.
        lora: LoRA settings (``--enable-lora``); None serves the base model only.
    """

    def __init__(self, profile: EngineProfile, *, kv_cache_tokens: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 frontend_overhead_s: float | None = None, lora: LoraSettings | None = None) -> None:
        self.profile = profile
        self.block_size = profile.block_size
        self.kv = BlockPool(kv_cache_tokens // profile.block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.frontend_overhead_s = (profile.frontend_overhead_s if frontend_overhead_s is None
                                    else frontend_overhead_s)
        self.stats = EngineStats(max_model_len)
        self.now = 0.0
        self.slow_factor = 1.0
        self.running: list[SimRequest] = []
        self._waiting: list[tuple[int, float, int, SimRequest]] = []
        #: Requests still in the API server (tokenising, IPC), in arrival order.
        self._pending: deque[SimRequest] = deque()
        self._seq = itertools.count()
        self.steps = 0
        self.busy_seconds = 0.0
        #: Step seconds weighted by the share of the engine's throughput each step used (:meth:`in_use`).
        self.used_seconds = 0.0
        self._step_time = profile.step_time
        #: Receives each step's KV-cache events (None: events are not recorded).
        self.kv_sink: Callable[[list[Event]], object] | None = None
        #: The adapters' engine side (None without ``--enable-lora``).
        self.lora: LoraEngine | None = None
        if lora is not None:
            self.lora = LoraEngine(lora, LoraCosts(profile.lora_load_s, profile.lora_activate_s,
                                                   profile.lora_step_overhead_s))

    def enable_kv_events(self, sink: Callable[[list[Event]], object]) -> None:
        """Record KV-cache events from now on and hand each step's list to ``sink``."""
        self.kv_sink = sink
        if self.kv.events is None:
            self.kv.events = []

    def flush_kv_events(self) -> None:
        """Hand the events recorded since the last flush to the sink as one batch (if any)."""
        events = self.kv.events
        if events and self.kv_sink is not None:
            self.kv.events = []
            self.kv_sink(events)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's ``/reset_prefix_cache``: forget every cached block, if none is in use.

        Args:
            reset_running_requests: Preempt every running request first (they recompute).

        Returns:
            Whether the cache was reset.
        """
        if reset_running_requests:
            while self.running:
                victim = self.running[-1]
                self._preempt(victim)
                self.stats.preemptions += 1
        return self.kv.reset_prefix_cache()

    # --- queue management ------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be scheduled (new or preempted)."""
        return len(self._waiting)

    @property
    def num_pending(self) -> int:
        """Requests that reached the server but not yet the scheduler."""
        return len(self._pending)

    def has_work(self) -> bool:
        """Whether there is anything to step for (including requests not yet arrived)."""
        return bool(self.running or self._waiting or self._pending)

    def advance_to(self, t: float) -> None:
        """Move the idle clock forward to ``t`` (never backwards)."""
        self.now = max(self.now, t)

    def add_request(self, req: SimRequest) -> None:
        """Accept a request that reached the server at ``req.arrival``.

        It joins the scheduler's waiting queue ``frontend_overhead_s`` later (the time the
        API server spends before handing it to the engine core), in simulated time.
        Arrivals must come in non-decreasing ``arrival`` order.
        """
        req.seq = next(self._seq)
        req.status = Status.WAITING
        req.queued_at = req.arrival + self.frontend_overhead_s
        self._pending.append(req)

    def abort(self, req: SimRequest) -> bool:
        """Remove a request wherever it is and free its KV blocks (client went away).

        Returns:
            True if the request was still in the engine.
        """
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            if req in self._pending:
                self._pending.remove(req)
            else:
                self._waiting = [e for e in self._waiting if e[3] is not req]
                heapq.heapify(self._waiting)
        else:
            return False
        self._release(req)
        if self.lora is not None:
            self.lora.untrack(req, req.first_token_at is not None)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        req.finished_at = self.now
        # vLLM 0.32 records no finished-request stats for a request its client abandoned:
        # request_success{finished_reason="abort"} and the latency histograms do not move.
        # The count is kept for /sim/state only.
        self.stats.aborted += 1
        return True

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> StepResult:
        """Schedule, "run" and sample one iteration; advance the clock by its duration.

        An idle engine first jumps its clock to the next request's arrival at the scheduler,
        plus the profile's ``idle_wakeup_s`` (what starting from idle costs on top of a step).
        """
        pending = self._pending
        if pending and not self.running and not self._waiting:
            self.now = max(self.now, pending[0].queued_at + self.profile.idle_wakeup_s)
        lora = self.lora
        if lora is not None and lora.busy_until > self.now:
            self.now = lora.busy_until  # an adapter load that began while idle holds the engine
        start = self.now
        while pending and pending[0].queued_at <= start:
            req = pending.popleft()
            heapq.heappush(self._waiting, (req.priority, req.arrival, req.seq, req))
        budget = self.max_num_batched_tokens
        scheduled: dict[SimRequest, int] = {}
        preempted: list[SimRequest] = []

        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            n = min(req.num_tokens - req.num_computed, budget)
            fits = self._grow(req, n)
            while not fits:
                victim = max(self.running, key=_victim_key)
                self._preempt(victim)
                preempted.append(victim)
                budget += scheduled.pop(victim, 0)
                if victim is req:
                    break
                fits = self._grow(req, n)
            if fits:
                scheduled[req] = n
                budget -= n

        if not preempted:
            if lora is None:
                budget = self._admit_waiting(start, budget, scheduled)
            else:
                budget = self._admit_waiting_lora(start, budget, scheduled, lora)

        return self._execute(start, scheduled, preempted)

    def _admission(self, req: SimRequest, budget: int) -> tuple[list[int], int, int] | None:
        """(cache-hit blocks, tokens to compute now, new blocks) if ``req`` fits now."""
        bs = self.block_size
        # Reuse whole cached blocks, but always recompute the last token (vLLM needs its
        # logits), so a fully cached prompt still costs one small prefill.
        hashes = req.full_block_hashes((req.num_tokens - 1) // bs, bs)
        hits = self.kv.lookup(hashes)
        computed = len(hits) * bs
        n = min(req.num_tokens - computed, budget)
        need = -(-(computed + n) // bs) - len(hits)
        if need > self.kv.num_free - self.kv.evictable_among(hits):
            return None
        return hits, n, need

    def head_admissible(self, budget: int) -> bool:
        """Whether the next waiting request would be admitted with ``budget`` tokens left."""
        if not self._waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return False
        return self._admission(self._waiting[0][3], budget) is not None

    def lora_skips(self, budget: int, lora: LoraEngine) -> list[SimRequest] | None:
        """With LoRA, when every running request is scheduled next step: None if that step would admit a
        waiting request with ``budget`` tokens left, else the waiting requests it would skip for the
        adapter limit (those ahead of the first one it tries and cannot fit)."""
        skipped: list[SimRequest] = []
        if not self._waiting or budget <= 0 or len(self.running) >= self.max_num_seqs:
            return skipped
        loras = {r.lora.int_id for r in self.running if r.lora is not None}
        for req in _heap_order(self._waiting):
            adapter = req.lora
            if adapter is not None and len(loras) >= lora.max_loras and adapter.int_id not in loras:
                skipped.append(req)
                continue
            return None if self._admission(req, budget) is not None else skipped
        return skipped

    @property
    def next_pending_at(self) -> float:
        """When the next request still in the API server reaches the scheduler (inf if none)."""
        return self._pending[0].queued_at if self._pending else float("inf")

    def _admit_waiting(self, start: float, budget: int, scheduled: dict[SimRequest, int]) -> int:
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._waiting[0][3]
            admission = self._admission(req, budget)
            if admission is None:
                break
            heapq.heappop(self._waiting)
            budget = self._admit(req, admission, start, scheduled, budget)
        return budget

    def _admit_waiting_lora(self, start: float, budget: int, scheduled: dict[SimRequest, int],
                            lora: LoraEngine) -> int:
        """``_admit_waiting`` with vLLM's ``max_loras`` rule (see the module docstring)."""
        waiting = self._waiting
        loras = {r.lora.int_id for r in scheduled if r.lora is not None}
        skipped: list[_Entry] = []
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = waiting[0][3]
            adapter = req.lora
            if adapter is not None and len(loras) >= lora.max_loras and adapter.int_id not in loras:
                skipped.append(heapq.heappop(waiting))
                lora.deferred[req] = None
                continue
            admission = self._admission(req, budget)
            if admission is None:
                break
            heapq.heappop(waiting)
            lora.deferred.pop(req, None)
            budget = self._admit(req, admission, start, scheduled, budget)
            if adapter is not None:
                loras.add(adapter.int_id)
        for entry in skipped:
            heapq.heappush(waiting, entry)
        return budget

    def _admit(self, req: SimRequest, admission: tuple[list[int], int, int], start: float,
               scheduled: dict[SimRequest, int], budget: int) -> int:
        """Start (or resume) the waiting request ``req``, already off the queue; the budget left."""
        hits, n, need = admission
        computed = len(hits) * self.block_size
        self.kv.touch(hits)
        req.blocks = hits + self.kv.allocate(need)
        req.num_computed = computed
        req.num_registered = len(hits)
        req.status = Status.RUNNING
        self.running.append(req)
        if req.scheduled_at is None:
            req.scheduled_at = start
            req.num_cached_tokens = computed
            self.stats.prefix_queries += req.num_tokens
            self.stats.prefix_hits += computed
            self.stats.queue.observe(max(0.0, start - req.queued_at))
        scheduled[req] = n
        return budget - n

    def _execute(self, start: float, scheduled: dict[SimRequest, int],
                 preempted: list[SimRequest]) -> StepResult:
        tokens = kv_read = pairs = prefill = 0
        for req, n in scheduled.items():
            c = req.num_computed
            tokens += n
            kv_read += c + n
            pairs += n * c + n * (n + 1) // 2
            if n == 1 and req.output and c == req.num_tokens - 1:
                continue
            prefill += n
        if scheduled:
            duration = self.profile.step_seconds(tokens, len(scheduled), kv_read, pairs)
            share = self.in_use(len(scheduled), tokens, kv_read, pairs)
        else:
            duration = self.profile.step_overhead_s  # nothing fit: let time pass, no spin
            share = 0.0
        lora = self.lora
        if lora is not None:
            duration += lora.prepare([r.lora for r in scheduled if r.lora is not None])
        duration *= self.slow_factor
        end = start + duration
        self.now = end
        self.steps += 1
        self.busy_seconds += duration
        self.used_seconds += duration * share
        stats = self.stats
        result = StepResult(start=start, duration=duration, scheduled=len(scheduled),
                            prefill_tokens=prefill, decode_tokens=tokens - prefill,
                            preempted=preempted)
        itl: dict[float, int] = {}
        first_prompts = 0  # prompt tokens computed for the requests that got their first token
        for req, n in scheduled.items():
            req.num_computed += n
            self.register_full_blocks(req)
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.generate(1)
            if req.first_token_at is None:
                req.first_token_at = end
                stats.ttft.observe(end - req.arrival)
                stats.prompt_tokens += len(req.prompt)
                stats.prompt_tokens_cached += req.num_cached_tokens
                first_prompts += len(req.prompt) - req.num_cached_tokens
                if lora is not None:
                    lora.track(req)
            else:
                gap = end - req.last_token_at
                itl[gap] = itl.get(gap, 0) + 1
            req.last_token_at = end
            result.emitted.append(req)
            if len(req.output) >= req.max_output:
                self.finish(req, end)
                result.finished.append(req)
        stats.generation_tokens += len(result.emitted)
        if result.emitted:
            # As vLLM 0.32 (IterationStats, recorded once per batch of engine outputs): only a step that
            # produced outputs, with the prompt tokens computed for its first tokens plus the tokens generated.
            stats.iteration_tokens.observe(first_prompts + len(result.emitted))
        stats.preemptions += len(preempted)
        for gap, count in itl.items():
            stats.itl.observe(gap, count)
        if result.finished:
            self.drop_finished()
        if lora is not None:
            lora.record(end)
        if self.kv.events:
            self.flush_kv_events()
        return result

    def in_use(self, num_seqs: int, num_tokens: int, kv_read_tokens: int, attn_pairs: int) -> float:
        """The share of the engine's throughput a step uses: the larger of its sequence slots taken and its
        compute's share of the roofline (:meth:`~switchyard.sim.measured.StepTimeModel.compute_share`).

        A step bound by reading weights and KV gains throughput with every sequence it batches, up to
        ``max_num_seqs``: its slots say how much of that it uses. A compute-bound step (a long prefill) turns
        over all the engine can whatever its slots: more work would only lengthen it.
        """
        slots = num_seqs / self.max_num_seqs
        if slots >= 1.0:
            return 1.0
        return max(slots, self._step_time.compute_share(num_tokens, kv_read_tokens, attn_pairs))

    def drop_finished(self) -> None:
        """Remove finished requests from the running list."""
        self.running = [r for r in self.running if r.status is Status.RUNNING]

    def max_output_left(self) -> int | None:
        """Fewest tokens any running request has left, or None if one is not decoding."""
        left: int | None = None
        for r in self.running:
            produced = len(r.output)
            if not produced or r.num_computed != len(r.prompt) + produced - 1:
                return None
            rest = r.max_output - produced
            if left is None or rest < left:
                left = rest
        return left

    def advance(self, until: float, max_steps: int = 4096) -> list[SimRequest]:
        """Step at least once, and on until the clock reaches ``until``.

        This is how a lagging engine catches up: every step up to "now" is computed in one
        go (runs of pure-decode steps in O(steps + batch), see ``fastpath``) and the
        requests that produced tokens are reported once. The result is exactly what calling
        ``step()`` repeatedly would give.

        Returns:
            Requests that produced at least one token (or finished), each once.
        """
        emitted: dict[SimRequest, None] = {}
        steps = 0
        while True:
            done = run_decodes(self, until, max_steps - steps, emitted)
            if done == 0:
                result = self.step()
                emitted.update(dict.fromkeys(result.emitted))
                done = 1
            steps += done
            if self.now >= until or steps >= max_steps or not self.has_work():
                return list(emitted)

    # --- helpers -----------------------------------------------------------------------------

    def _grow(self, req: SimRequest, n: int) -> bool:
        need = -(-(req.num_computed + n) // self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.kv.num_free:
            return False
        req.blocks.extend(self.kv.allocate(need))
        return True

    def register_full_blocks(self, req: SimRequest, full: int | None = None) -> None:
        """Put every newly full block of ``req`` into the prefix cache.

        Args:
            req: The request.
            full: Register up to this many blocks (default: all the computed tokens fill).
        """
        bs = self.block_size
        if full is None:
            full = req.num_computed // bs
        done = req.num_registered
        if full > done:
            hashes = req.full_block_hashes(full, bs)
            kv = self.kv
            for idx in range(done, full):
                kv.register(req.blocks[idx], hashes[idx])
            req.num_registered = full
            events = kv.events
            if events is not None:
                salt = req.cache_salt
                adapter = req.lora
                extra_keys: list[tuple[str, ...] | None]
                if adapter is None:
                    extra_keys = [(salt,) if salt and i == 0 else None for i in range(done, full)]
                else:  # vLLM's event keys: the adapter's name in every block, then the salt in the first
                    name = adapter.name
                    extra_keys = [(name, salt) if salt and i == 0 else (name,) for i in range(done, full)]
                events.append(BlockStored(
                    block_hashes=[h & HASH_MASK for h in hashes[done:full]],
                    parent_block_hash=hashes[done - 1] & HASH_MASK if done else None,
                    token_ids=req.tokens(done * bs, full * bs), block_size=bs,
                    lora_id=None if adapter is None else adapter.int_id, medium=MEDIUM_GPU,
                    lora_name=None if adapter is None else adapter.name,
                    extra_keys=extra_keys, group_idx=0))

    def _preempt(self, req: SimRequest) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        heapq.heappush(self._waiting, (req.priority, req.arrival, req.seq, req))

    def _release(self, req: SimRequest) -> None:
        self.kv.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered = 0

    def finish(self, req: SimRequest, end: float) -> None:
        """Complete ``req`` at time ``end``: free its blocks, record its metrics."""
        self._release(req)
        if self.lora is not None:
            self.lora.untrack(req, True)
        req.status = Status.FINISHED
        reason = req.final_reason
        req.finish_reason = reason
        req.finished_at = end
        self.stats.record_finished(req, end)
