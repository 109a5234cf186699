"""What finite caches allow: the oracle, and the unbounded-cache bound.

The **oracle** knows every engine's cache exactly and places each request where its cached prefix is
longest, subject to the same load limit as the gateway's herding guard: an engine is a candidate for
its cache only while its load (requests running and waiting in it) is at most the least loaded engine's
plus the guard's margin (``herd_margin``, 4 requests by default). Among candidates the longest cached
prefix wins (ties: the less loaded); when no candidate holds any of the prompt, the least loaded engine
takes it. The guard's other two conditions (nothing waiting in the engine, utilisation under the
ceiling) read the gateway's last scrape, which lags the engines; the oracle knows the engines' loads
exactly, so the margin is the limit it keeps (with them too it would yield nearly every hit at the
scenario's load, where a queue forms for moments on every engine).

It runs offline, on the simulator's own engine cores (:class:`switchyard.sim.core.EngineCore`, configured
as ``switchyard sim --policy`` configures the scenario's replicas: the same profile, KV cache, block pool
and scheduler), on the simulated clock: a request sent at ``t`` wall-clock seconds reaches its engine at
``t * time_scale`` simulated seconds, as on the scenario's simulated engines. Its hit ratio is what the
engines' counters say (``prefix_hits / prefix_queries``, the sums behind ``vllm:prefix_cache_*``), so it
compares with the arms' measured ratios term for term.

The oracle is a greedy placement, not a proof of optimality: a placement that gave up a hit now to keep
a prefix warm for later could do better. It is the reference the issue asks for ("as close as finite
caches allow"); the **unbounded bound** (one cache that never evicts) stays beside it.

The same offline run can place by least load or in turn (``placement``), which the scenario uses to
say how close to capacity its rate is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from switchyard.bench.prompts import SynthText
from switchyard.bench.spec import RequestSpec, Workload
from switchyard.sim.config import EngineConfig, ResolvedConfig, resolve
from switchyard.sim.core import EngineCore
from switchyard.sim.request import SimRequest
from switchyard.simtext.chat import render_chat
from switchyard.simtext.tokens import SPECIAL_TOKENS, tokenize

Placement = Literal["oracle", "least-loaded", "round-robin"]


@dataclass(slots=True)
class OfflineRun:
    """An offline placement of a workload on simulated engines.

    Attributes:
        placement: How requests were placed.
        hits: Prompt tokens the engines found in their prefix caches.
        queries: Prompt tokens the engines looked up.
        ttft_s: Each served request's time to first token, in wall-clock seconds (simulated / time scale).
        per_engine: Requests placed on each engine, in policy order.
        busy: Mean fraction of the run the engines were busy.
    """

    placement: Placement
    hits: int = 0
    queries: int = 0
    ttft_s: list[float] = field(default_factory=list)
    per_engine: list[int] = field(default_factory=list)
    busy: float | None = None

    @property
    def hit_ratio(self) -> float | None:
        """``hits / queries`` (None: nothing was looked up)."""
        return self.hits / self.queries if self.queries else None


def engine(config: EngineConfig) -> tuple[ResolvedConfig, EngineCore]:
    """A simulated engine core as ``switchyard sim`` builds one from ``config``."""
    resolved = resolve(config)
    return resolved, EngineCore(resolved.profile, kv_cache_tokens=resolved.kv_cache_tokens,
                                max_num_seqs=resolved.max_num_seqs,
                                max_num_batched_tokens=resolved.max_num_batched_tokens,
                                max_model_len=resolved.max_model_len)


def prompt_ids(spec: RequestSpec) -> list[int]:
    """The token ids a simulated engine makes of ``spec``'s prompt (chat template included)."""
    body = spec.body()
    if "messages" in body:
        return render_chat(body["messages"])
    return [SPECIAL_TOKENS["<|begin_of_text|>"], *tokenize(str(body["prompt"]))]


def cached_tokens(core: EngineCore, request: SimRequest) -> int:
    """Tokens of ``request``'s prompt that ``core`` holds now (whole blocks, as its scheduler would reuse
    them: never the prompt's last token)."""
    size = core.block_size
    hashes = request.full_block_hashes((len(request.prompt) - 1) // size, size)
    return len(core.kv.lookup(hashes)) * size


def load(core: EngineCore) -> float:
    """Requests in the engine: running and waiting (what the gateway's load counts, exactly)."""
    return float(len(core.running) + core.num_waiting + core.num_pending)


def choose(loads: Sequence[float], cached: Sequence[int], *, herd_margin: float) -> int:
    """The oracle's pick: the longest cached prefix among the engines within ``herd_margin`` requests of the
    least loaded, else the least loaded (ties: the less loaded, then the first)."""
    least = min(loads)
    allowed = [i for i in range(len(loads)) if loads[i] <= least + herd_margin and cached[i] > 0]
    if not allowed:
        return min(range(len(loads)), key=lambda i: (loads[i], i))
    return min(allowed, key=lambda i: (-cached[i], loads[i], i))


def offline(config: EngineConfig, replicas: int, workload: Workload, *, time_scale: float,
            placement: Placement = "oracle", herd_margin: float = 4.0) -> OfflineRun:
    """Place ``workload``'s requests on ``replicas`` engines built from ``config`` (see the module doc)."""
    engines = [engine(config) for _ in range(replicas)]
    cores = [core for _, core in engines]
    max_model_len = engines[0][0].max_model_len
    run = OfflineRun(placement, per_engine=[0] * replicas)
    sent: list[SimRequest] = []
    turn = 0
    for spec in workload.specs:
        now = spec.arrival_s * time_scale
        for core in cores:
            while core.has_work() and core.now < now:
                core.advance(now)
            core.advance_to(now)
        ids = prompt_ids(spec)
        request = SimRequest(request_id=str(spec.index), prompt=ids, max_output=spec.max_tokens, arrival=now,
                             seed=config.seed + spec.index, budget=spec.max_tokens)
        if placement == "round-robin":
            pick = turn % replicas
            turn += 1
        else:
            loads = [load(core) for core in cores]
            if placement == "least-loaded":
                pick = min(range(replicas), key=lambda i: (loads[i], i))
            else:
                pick = choose(loads, [cached_tokens(core, request) for core in cores], herd_margin=herd_margin)
        if len(ids) + spec.max_tokens > max_model_len:
            continue
        cores[pick].add_request(request)
        run.per_engine[pick] += 1
        sent.append(request)
    end = 0.0
    for core in cores:
        while core.has_work():
            core.advance(core.now + 3600.0)
        end = max(end, core.now)
        run.hits += core.stats.prefix_hits
        run.queries += core.stats.prefix_queries
    run.ttft_s = [(r.first_token_at - r.arrival) / time_scale for r in sent if r.first_token_at is not None]
    first = workload.specs[0].arrival_s * time_scale if workload.specs else 0.0
    if end > first:
        run.busy = sum(core.busy_seconds for core in cores) / (replicas * (end - first))
    return run


def unbounded_bound(workload: Workload) -> tuple[int, int]:
    """Prompt tokens one never-evicting cache would hit on ``workload``, and all prompt tokens.

    Requests are taken in arrival order. A request's leading segments (trace blocks) hit while
    each was in an earlier request at least as long (a shorter earlier copy hits its length and
    ends the run); the first segment that was never seen ends it too.
    """
    seen: dict[int, int] = {}
    hits = total = 0
    for spec in workload.specs:
        prompt = spec.prompt
        if not isinstance(prompt, SynthText):
            total += prompt.tokens
            continue
        leading = True
        for key, tokens in prompt.segments:
            total += tokens
            if leading:
                known = seen.get(key, 0)
                hits += min(known, tokens)
                leading = known >= tokens
            seen[key] = max(seen.get(key, 0), tokens)
    return hits, total
