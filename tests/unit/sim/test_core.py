"""The engine core: prefix cache, batching, budgets, queueing, preemption, priority."""

from __future__ import annotations

import pytest

from switchyard.sim.request import Status

from .conftest import CoreFactory, make_request, prompt_of, run_until_done


def _ttft(core_factory: CoreFactory, prompts: list[list[int]]) -> list[float]:
    """Serve prompts one after another on one core; TTFT of each (simulated seconds)."""
    core = core_factory()
    out = []
    for prompt in prompts:
        req = make_request(prompt, max_output=2, arrival=core.now)
        core.add_request(req)
        run_until_done(core, [req])
        assert req.first_token_at is not None
        out.append(req.first_token_at - req.arrival)
    return out


def test_shared_prefix_hits_the_cache_and_a_different_one_does_not(
        make_core: CoreFactory) -> None:
    core = make_core()
    system = prompt_of(640)
    first = make_request(system + prompt_of(40, offset=1), arrival=0.0)
    core.add_request(first)
    run_until_done(core, [first])
    same_prefix = make_request(system + prompt_of(40, offset=2), arrival=core.now)
    core.add_request(same_prefix)
    run_until_done(core, [same_prefix])
    other = make_request(prompt_of(680, offset=3), arrival=core.now)
    core.add_request(other)
    run_until_done(core, [other])

    assert first.num_cached_tokens == 0
    assert same_prefix.num_cached_tokens == 640  # 40 whole blocks of the shared prefix
    assert other.num_cached_tokens == 0
    assert core.stats.prefix_hits == 640
    assert core.stats.prefix_queries == 680 * 3


def test_fully_cached_prompt_still_computes_its_last_token(make_core: CoreFactory) -> None:
    core = make_core()
    prompt = prompt_of(320)  # exactly 20 blocks
    for _ in range(2):
        req = make_request(prompt, arrival=core.now)
        core.add_request(req)
        run_until_done(core, [req])
    assert req.num_cached_tokens == 304  # the last block is recomputed for its last token


def test_repeated_prompt_second_ttft_is_far_lower(make_core: CoreFactory) -> None:
    prompt = prompt_of(6000)
    cold, warm = _ttft(make_core, [prompt, prompt])
    assert warm < cold / 5


def test_uncached_tokens_drive_prefill_time(make_core: CoreFactory) -> None:
    short, long_ = _ttft(make_core, [prompt_of(2000), prompt_of(6000, offset=1)])
    assert long_ > 2.5 * short


def test_lru_eviction_under_pressure(make_core: CoreFactory) -> None:
    core = make_core(kv_cache_tokens=16 * 40, max_model_len=600)  # 40 blocks
    a, b, c = prompt_of(320, 1), prompt_of(320, 2), prompt_of(320, 3)  # 20 blocks each
    for prompt in (a, b):
        req = make_request(prompt, arrival=core.now)
        core.add_request(req)
        run_until_done(core, [req])
    # a and b are both cached (40 blocks); c needs 20 of them: a, the older, goes.
    req_c = make_request(c, arrival=core.now)
    core.add_request(req_c)
    run_until_done(core, [req_c])
    again_b = make_request(b, arrival=core.now)
    core.add_request(again_b)
    run_until_done(core, [again_b])
    again_a = make_request(a, arrival=core.now)
    core.add_request(again_a)
    run_until_done(core, [again_a])
    assert again_b.num_cached_tokens > 280
    assert again_a.num_cached_tokens == 0
    assert core.kv.evictions > 0


def test_chunked_prefill_respects_the_token_budget(make_core: CoreFactory) -> None:
    core = make_core(max_num_batched_tokens=512)
    decoding = make_request(prompt_of(10), max_output=50)
    core.add_request(decoding)
    core.step()  # its prefill
    big = make_request(prompt_of(2000, offset=1), max_output=2, arrival=core.now)
    core.add_request(big)
    steps = []
    while big.first_token_at is None:
        result = core.step()
        steps.append(result)
        assert result.prefill_tokens + result.decode_tokens <= 512
        assert decoding in result.emitted or decoding.status is Status.FINISHED
    # 2000 prompt tokens at 511 per step (one token of the budget goes to the decode).
    assert len(steps) == 4
    assert steps[0].prefill_tokens == 511
    assert steps[0].decode_tokens == 1


def test_decode_step_time_grows_with_batch_size(make_core: CoreFactory) -> None:
    def decode_step_time(batch: int) -> float:
        core = make_core()
        reqs = [make_request(prompt_of(500, i), max_output=100) for i in range(batch)]
        for r in reqs:
            core.add_request(r)
        while any(not r.output for r in reqs):
            core.step()  # prefills, chunked by the 8192-token budget
        result = core.step()
        assert result.decode_tokens == batch and result.prefill_tokens == 0
        return result.duration

    t1, t16, t64, t256 = (decode_step_time(b) for b in (1, 16, 64, 256))
    assert t1 < t16 < t64 < t256
    assert 0.006 < t1 < 0.012  # sanity: 6-12 ms per token at batch 1 on an H100


def test_requests_queue_when_max_num_seqs_is_reached(make_core: CoreFactory) -> None:
    core = make_core(max_num_seqs=2)
    reqs = [make_request(prompt_of(20, i), max_output=5) for i in range(3)]
    for r in reqs:
        core.add_request(r)
    core.step()
    assert len(core.running) == 2 and core.num_waiting == 1
    assert reqs[2].status is Status.WAITING
    run_until_done(core, reqs)
    assert reqs[2].scheduled_at is not None and reqs[0].finished_at is not None
    assert reqs[2].scheduled_at >= reqs[0].finished_at


def test_requests_queue_when_kv_blocks_run_out(make_core: CoreFactory) -> None:
    core = make_core(kv_cache_tokens=16 * 30, max_model_len=400)  # 30 blocks
    first = make_request(prompt_of(320, 1), max_output=3)  # 20 blocks (+1 for decode)
    second = make_request(prompt_of(320, 2), max_output=3, arrival=0.001)
    core.add_request(first)
    core.add_request(second)
    core.step()
    assert first.status is Status.RUNNING
    assert second.status is Status.WAITING
    run_until_done(core, [first, second])
    assert core.stats.preemptions == 0
    assert second.scheduled_at is not None and first.finished_at is not None
    assert second.scheduled_at >= first.finished_at


def test_preemption_when_kv_runs_out(make_core: CoreFactory) -> None:
    core = make_core(kv_cache_tokens=16 * 12, max_model_len=190)  # 12 blocks
    early = make_request(prompt_of(64, 1), max_output=100, arrival=0.0)  # 4 blocks, grows
    late = make_request(prompt_of(64, 2), max_output=100, arrival=0.001)
    core.add_request(early)
    core.add_request(late)
    results = run_until_done(core, [early, late])
    assert core.stats.preemptions >= 1
    assert late.num_preemptions >= 1  # the latest arrival is the victim
    assert early.num_preemptions == 0
    assert any(r.preempted for r in results)
    assert len(early.output) == 100 and len(late.output) == 100
    assert core.kv.num_used == 0


def test_preemption_picks_the_lowest_priority(make_core: CoreFactory) -> None:
    core = make_core(kv_cache_tokens=16 * 12, max_model_len=190)
    background = make_request(prompt_of(64, 1), max_output=100, priority=5, arrival=0.0)
    urgent = make_request(prompt_of(64, 2), max_output=100, priority=0, arrival=0.001)
    core.add_request(background)
    core.add_request(urgent)
    run_until_done(core, [background, urgent])
    assert background.num_preemptions >= 1
    assert urgent.num_preemptions == 0


def test_waiting_queue_is_ordered_by_priority_then_arrival(make_core: CoreFactory) -> None:
    core = make_core(max_num_seqs=1)
    blocker = make_request(prompt_of(10), max_output=3)
    core.add_request(blocker)
    core.step()
    low = make_request(prompt_of(10, 1), max_output=2, priority=10, arrival=core.now)
    mid_early = make_request(prompt_of(10, 2), max_output=2, priority=1, arrival=core.now)
    mid_late = make_request(prompt_of(10, 3), max_output=2, priority=1, arrival=core.now + 1e-6)
    high = make_request(prompt_of(10, 4), max_output=2, priority=-1, arrival=core.now + 2e-6)
    for r in (low, mid_early, mid_late, high):
        core.add_request(r)
    run_until_done(core, [blocker, low, mid_early, mid_late, high])
    order = sorted((low, mid_early, mid_late, high), key=lambda r: r.scheduled_at or 0.0)
    assert order == [high, mid_early, mid_late, low]


def test_exact_output_length(make_core: CoreFactory) -> None:
    core = make_core()
    reqs = [make_request(prompt_of(30, i), max_output=n) for i, n in enumerate((1, 7, 300))]
    for r in reqs:
        core.add_request(r)
    run_until_done(core, reqs)
    assert [len(r.output) for r in reqs] == [1, 7, 300]
    assert all(r.finish_reason == "length" for r in reqs)
    assert core.stats.generation_tokens == 308
    assert core.stats.finished["length"] == 3


def test_abort_frees_kv_blocks(make_core: CoreFactory) -> None:
    core = make_core()
    req = make_request(prompt_of(100), max_output=1000)
    core.add_request(req)
    core.step()
    core.step()
    assert core.kv.num_used > 0
    assert core.abort(req)
    assert core.kv.num_used == 0
    assert not core.has_work()
    assert req.finish_reason == "abort"
    assert core.stats.finished["abort"] == 0  # vLLM does not count a request its client abandoned
    assert core.stats.e2e.count == 0
    assert not core.abort(req)


def test_idle_engine_jumps_to_the_next_arrival(make_core: CoreFactory) -> None:
    core = make_core(frontend_overhead_s=0.006)
    req = make_request(prompt_of(10), max_output=1, arrival=5.0)
    core.add_request(req)
    result = core.step()
    assert result.start == 5.006  # arrival plus the API server's overhead
    assert req.first_token_at is not None
    assert req.first_token_at - req.arrival > 0.006


def test_kv_usage_and_queue_metrics(make_core: CoreFactory) -> None:
    core = make_core(max_num_seqs=1)
    reqs = [make_request(prompt_of(50, i), max_output=10) for i in range(2)]
    for r in reqs:
        core.add_request(r)
    core.step()
    assert 0 < core.kv.usage < 1
    run_until_done(core, reqs)
    stats = core.stats
    assert stats.queue.count == 2 and stats.queue.sum > 0  # the second one waited
    assert stats.ttft.count == 2 and stats.e2e.count == 2
    assert stats.itl.count == 18
    assert stats.prompt_tokens == 100


def _scenario(make_core: CoreFactory, use_advance: bool) -> tuple[object, ...]:
    """A busy mixed workload; returns everything observable about how it ran."""
    core = make_core(kv_cache_tokens=16 * 400, max_model_len=2048, max_num_seqs=24,
                     max_num_batched_tokens=1024, frontend_overhead_s=0.004)
    shared = prompt_of(200, 9)
    reqs = []
    for i in range(60):
        prompt = (shared if i % 3 == 0 else []) + prompt_of(30 + (i * 37) % 400, i)
        reqs.append(make_request(prompt, max_output=5 + (i * 53) % 300, priority=i % 4,
                                 arrival=0.002 * i, seed=i))
    # Arrivals trickle in while the engine runs, in arrival order.
    pending = list(reqs)
    while pending or core.has_work():
        while pending and (pending[0].arrival <= core.now or not core.has_work()):
            core.add_request(pending.pop(0))
        if use_advance:
            horizon = pending[0].arrival if pending else float("inf")
            core.advance(until=horizon)
        else:
            core.step()
    s = core.stats
    return (
        core.now, core.steps, core.busy_seconds, core.used_seconds,
        [(r.output, r.first_token_at, r.finished_at, r.num_cached_tokens, r.num_preemptions)
         for r in reqs],
        s.prompt_tokens, s.generation_tokens, s.preemptions, s.prefix_hits, s.prefix_queries,
        s.itl.counts, s.itl.sum, s.ttft.counts, s.e2e.counts, s.iteration_tokens.counts,
        core.kv.evictions, core.kv.num_cached,
    )


def test_batched_advance_is_identical_to_single_steps(make_core: CoreFactory) -> None:
    stepped = _scenario(make_core, use_advance=False)
    advanced = _scenario(make_core, use_advance=True)
    preemptions = stepped[7]
    assert isinstance(preemptions, int) and preemptions > 0  # every path is exercised
    assert advanced == stepped


def test_advance_uses_decode_runs(make_core: CoreFactory) -> None:
    core = make_core()
    reqs = [make_request(prompt_of(100, i), max_output=500) for i in range(50)]
    for r in reqs:
        core.add_request(r)
    core.step()  # all prefills
    emitted = core.advance(until=core.now + 0.5)
    assert set(emitted) == set(reqs)  # each reported once, however many steps ran
    assert core.steps > 20
    assert all(len(r.output) == core.steps for r in reqs)


def test_iteration_tokens_are_observed_as_vllm_observes_them(make_core: CoreFactory) -> None:
    """vLLM 0.32 observes ``vllm:iteration_tokens_total`` once per batch of engine outputs (a step that
    produced none, such as a prefill chunk that did not reach the prompt's end, is not observed), with the
    prompt tokens computed for the requests that got their first token plus the tokens generated
    (``IterationStats``, ``vllm/v1/metrics/loggers.py``)."""
    core = make_core(max_num_batched_tokens=1024)
    hist = core.stats.iteration_tokens
    long = make_request(prompt_of(2500), max_output=3)
    core.add_request(long)
    steps = run_until_done(core, [long])
    assert len(steps) == 5  # chunks of 1024, 1024 and 452 tokens (the last makes the first token), 2 decodes
    assert hist.count == 3 and hist.sum == 2500 + 1 + 1 + 1
    assert core.stats.prompt_tokens == 2500 and core.stats.generation_tokens == 3

    # A repeat computes only what the cache misses (its last block, 2500 % 16 = 4 tokens).
    again = make_request(prompt_of(2500), max_output=2, arrival=core.now)
    core.add_request(again)
    run_until_done(core, [again])
    assert again.num_cached_tokens == 2496
    assert hist.count == 5 and hist.sum == 2503 + (4 + 1) + 1

    # Two requests in one step: one observation for the step, whatever it holds.
    a, b = (make_request(prompt_of(40, offset=k), max_output=2, arrival=core.now) for k in (5, 6))
    core.add_request(a)
    core.add_request(b)
    first = core.step()
    assert first.emitted == [a, b] and hist.count == 6 and hist.sum == 2509 + 40 + 40 + 2
    run_until_done(core, [a, b])
    assert hist.count == 7 and hist.sum == 2591 + 2


def test_a_recomputed_prompt_is_not_counted_again(make_core: CoreFactory) -> None:
    """After a preemption vLLM's prefill stats are spent: the recompute step counts the token it makes only."""
    core = make_core(kv_cache_tokens=16 * 12, max_num_batched_tokens=4096)
    low = make_request(prompt_of(90), max_output=60, priority=1)
    high = make_request(prompt_of(90, offset=1), max_output=60, priority=0)
    for r in (low, high):
        core.add_request(r)
    run_until_done(core, [low, high])
    assert low.num_preemptions + high.num_preemptions >= 1
    hist = core.stats.iteration_tokens
    assert hist.sum == 90 + 90 + 60 + 60 == core.stats.prompt_tokens + core.stats.generation_tokens


def test_throughput_in_use_counts_slots_for_decodes_and_all_of_a_compute_bound_prefill(
        make_core: CoreFactory) -> None:
    core = make_core(max_num_seqs=4)
    core.add_request(make_request(prompt_of(1500, 7), max_output=20))
    prefill = core.step()  # the prompt alone: compute-bound, all of the engine's throughput
    assert prefill.prefill_tokens == 1500
    assert core.used_seconds == pytest.approx(prefill.duration)
    core.add_request(make_request(prompt_of(8, 8), max_output=20))
    core.step()  # a decode and a short prefill
    before_used, before_busy = core.used_seconds, core.busy_seconds
    decodes = core.step()  # two decodes of four slots: bound by reading the weights and KV
    assert decodes.prefill_tokens == 0 and decodes.scheduled == 2
    assert core.used_seconds - before_used == pytest.approx(0.5 * (core.busy_seconds - before_busy))
    assert core.in_use(4, 4, 3000, 3000) == 1.0
    assert 0.25 < core.in_use(1, 100, 100, 5050) < 1.0  # a short chunk: its compute is part of the step
