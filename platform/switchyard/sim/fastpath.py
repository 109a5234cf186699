"""Runs of pure-decode steps computed in one go.

Under load an engine spends most steps doing nothing but one decode token per running
request: no admission, no arrival, no finish, no preemption. Stepping those one by one costs
O(batch) Python work per step, which at 500 streams and ``time_scale`` 10 is more CPU than a
step's wall-clock budget. ``run_decodes`` recognises such a run and applies K steps at once:
step durations are computed per step (they grow as contexts grow), then every request gets
its K tokens and blocks in one pass. It refuses (returns 0) whenever a step could do anything
else, so ``EngineCore.advance`` falls back to ``step()``; the outcome — clock, tokens, KV
blocks, metrics — is identical to stepping one at a time (a unit test checks this). With LoRA, a run
keeps its batch and so its adapters: each step adds their per-adapter cost, a step that would load or copy
an adapter (or wait for a runtime load) is left to ``step()``, and the waiting requests every step of the
run would skip for the adapter limit are marked deferred, as those steps would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from switchyard.sim.core import EngineCore
    from switchyard.sim.request import SimRequest


def _blocks_needed(running: list[SimRequest], k: int, block_size: int) -> int:
    return sum(max(0, -(-(r.num_computed + k) // block_size) - len(r.blocks)) for r in running)


def run_decodes(core: EngineCore, until: float, max_steps: int,
                emitted: dict[SimRequest, None]) -> int:
    """Apply as many pure-decode steps as possible, stopping once the clock passes ``until``.

    Args:
        core: The engine core.
        until: Simulated time to reach (at least one step is done if any can be).
        max_steps: Most steps to apply.
        emitted: Requests that produced tokens are added here.

    Returns:
        Steps applied; 0 if the next step is not a pure-decode step.
    """
    running = core.running
    batch = len(running)
    if not running or max_steps <= 0 or batch > core.max_num_batched_tokens:
        return 0
    if core.next_pending_at <= core.now:
        return 0  # an arrival joins the queue at the next step
    remaining = core.max_output_left()
    if remaining is None:
        return 0  # someone is still prefilling
    # Admission only gets harder while decodes grow, so a blocked queue head stays blocked.
    lora = core.lora
    extra = 0.0
    skipped: list[SimRequest] | None = None
    if lora is None:
        if core.head_admissible(core.max_num_batched_tokens - batch):
            return 0
    else:
        # With adapters the batch and so the skipped waiting requests stay the same for the whole run,
        # and so does the first one tried; a step that loads or copies an adapter is not a plain decode.
        skipped = core.lora_skips(core.max_num_batched_tokens - batch, lora)
        overhead = lora.decode_overhead(running)
        if skipped is None or overhead is None:
            return 0
        extra = overhead

    profile, factor = core.profile, core.slow_factor
    context = sum(r.num_computed for r in running)
    next_arrival = core.next_pending_at
    t = core.now
    ends: list[float] = []
    durations: list[float] = []
    used: list[float] = []  # each step's duration times its share of the engine's throughput (``in_use``)
    limit = min(remaining, max_steps)
    while len(ends) < limit:
        if ends and (t >= until or t >= next_arrival):
            break
        kv_read = context + batch * (len(ends) + 1)
        d = (profile.step_seconds(batch, batch, kv_read, kv_read) + extra) * factor
        durations.append(d)
        used.append(d * core.in_use(batch, batch, kv_read, kv_read))
        t = t + d
        ends.append(t)

    k = len(ends)
    free, bs = core.kv.num_free, core.block_size
    if _blocks_needed(running, k, bs) > free:
        lo, hi = 0, k  # the largest run that needs no preemption
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _blocks_needed(running, mid, bs) <= free:
                lo = mid
            else:
                hi = mid - 1
        k = lo
        if k == 0:
            return 0
        ends, durations, used = ends[:k], durations[:k], used[:k]

    if lora is not None and skipped:
        lora.deferred.update(dict.fromkeys(skipped))
    _apply(core, k, ends, durations, used, emitted)
    return k


def _apply(core: EngineCore, k: int, ends: list[float], durations: list[float], used: list[float],
           emitted: dict[SimRequest, None]) -> None:
    running = core.running
    batch = len(running)
    stats = core.stats
    itl: dict[float, int] = {}
    first_end = ends[0]
    for r in running:
        gap = first_end - r.last_token_at
        itl[gap] = itl.get(gap, 0) + 1
    for j in range(1, k):
        gap = ends[j] - ends[j - 1]
        itl[gap] = itl.get(gap, 0) + batch
    for gap, count in itl.items():
        stats.itl.observe(gap, count)
    stats.iteration_tokens.observe(batch, k)
    stats.generation_tokens += batch * k
    for d in durations:
        core.busy_seconds += d
    for u in used:
        core.used_seconds += u
    core.steps += k
    end = ends[-1]
    core.now = end

    lora = core.lora
    if lora is not None:
        lora.touch(running)
        if k > 1:
            lora.record(ends[-2])  # the run's last step may finish requests: it records after them
    kv, bs = core.kv, core.block_size
    finished: list[SimRequest] = []
    if kv.events is not None:
        _blocks_step_by_step(core, k)
    for r in running:  # every allocation of the run happens before any finish frees blocks
        if kv.events is None:
            r.generate(k)
            r.num_computed += k
            need = -(-r.num_computed // bs) - len(r.blocks)
            if need > 0:
                r.blocks.extend(kv.allocate(need))
            core.register_full_blocks(r)
        r.last_token_at = end
        emitted[r] = None
        if len(r.output) >= r.max_output:
            finished.append(r)
    for r in finished:
        core.finish(r, end)
    if finished:
        core.drop_finished()
    if lora is not None:
        lora.record(end)


def _blocks_step_by_step(core: EngineCore, k: int) -> None:
    """The run's tokens, allocations and registrations with KV events on: one event batch per step.

    Only the steps where a request starts or fills a block do anything, so this costs
    O(batch + blocks), not O(batch * k). In each step, allocations (and the evictions they
    cause) come before registrations, as in ``EngineCore.step``.
    """
    kv, bs = core.kv, core.block_size
    work: list[tuple[int, int, int, int]] = []  # (step, 0 allocate / 1 register, request, blocks)
    running = core.running
    for order, r in enumerate(running):
        c = r.num_computed  # the token at position p is computed in step p - c of the run
        r.generate(k)
        r.num_computed = c + k
        for start in range(len(r.blocks) * bs, c + k, bs):
            work.append((start - c, 0, order, 0))
        for last in range((c // bs + 1) * bs - 1, c + k, bs):
            work.append((last - c, 1, order, (last + 1) // bs))
    work.sort()
    step = work[0][0] if work else 0
    for at, kind, order, full in work:
        if at != step:
            core.flush_kv_events()
            step = at
        r = running[order]
        if kind == 0:
            r.blocks.extend(kv.allocate(1))
        else:
            core.register_full_blocks(r, full)
    core.flush_kv_events()
