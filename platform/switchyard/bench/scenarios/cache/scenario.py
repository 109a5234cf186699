"""The ``cache`` scenario's run: the engines, one gateway, a warm-up, both arms one after the other, then the
report (what the scenario registry calls is :func:`run`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from switchyard.api.headers import CACHE_CONTROL_HEADER, CACHE_HEADER
from switchyard.bench.loadgen import connection_limit
from switchyard.bench.policies import TENANT, TIER, cache_policy
from switchyard.bench.procs import free_ports
from switchyard.bench.prompts import LiteralText, PromptText, SynthText, unique_key
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler, scrape_text
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.cache.analysis import analyse
from switchyard.bench.scenarios.cache.counters import (
    ARMS,
    BASELINE,
    GAUGE_REFRESH_S,
    ArmRun,
    Counters,
    Seen,
    parse_cache_header,
    read_counters,
)
from switchyard.bench.scenarios.cache.questions import MIN_SIMILARITY, PARAPHRASE_FLOOR, faq_questions
from switchyard.bench.scenarios.cache.report import goals_of, tables_of
from switchyard.bench.scenarios.cache.workload import (
    CHAT_ITEMS,
    CHAT_PROMPT_TOKENS,
    FAMILIES,
    FAQ_QUESTIONS,
    MODELS,
    PARAPHRASE_SHARE,
    SHARES,
    STREAM_SHARE,
    ZIPF_S,
    CacheWorkload,
    Family,
    build_workload,
    public_repeats,
    repeat_bounds,
)
from switchyard.bench.sender import Target, send_one
from switchyard.bench.spec import Labels, RequestSpec, Workload
from switchyard.bench.stack import create_key, start_gateway, start_sims, state_env
from switchyard.figures import fixed, percent

REPLICAS = 2
PROFILE = "h100-8b"
SERVED = "sim-8b"
EMBED_SERVED = "sim-emb"
KV_TOKENS = 100_000
CONTEXT = 8192
TIME_SCALE = 1.0
RATE = 12.0
DURATION_S = 60.0
QUICK_DURATION_S = 6.0
CLIENT_TIMEOUT_S = 60.0
SCRAPE_TIMEOUT_S = 5.0
#: Wait after an arm's last answer before reading the counters (a miss is stored just after it is sent).
SETTLE_S = 0.5
BASELINE_CONTROL = "no-cache, no-store"
RUNNING = "vllm:num_requests_running"


async def drive(workload: Workload, target: Target, *, timeout_s: float = CLIENT_TIMEOUT_S,
                on_start: Callable[[float], None] | None = None) -> tuple[list[Result], list[Seen]]:
    """Send every request of ``workload`` at its time (open loop, like ``bench.loadgen``), keeping each
    response's ``x-switchyard-cache`` header (read when the response's head arrives)."""
    specs = workload.specs
    heads: dict[int, str | None] = {}
    prefix = f"bench-{target.name}-"

    async def ended(_session: aiohttp.ClientSession, _ctx: Any, params: aiohttp.TraceRequestEndParams) -> None:
        rid = params.headers.get("x-request-id", "")
        if rid.startswith(prefix) and rid[len(prefix):].isdigit():
            heads[int(rid[len(prefix):])] = params.response.headers.get(CACHE_HEADER)

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(ended)
    connector = aiohttp.TCPConnector(limit=connection_limit(specs, timeout_s), limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0)
    loop = asyncio.get_running_loop()
    now = loop.time
    results: list[Result] = []
    tasks: list[asyncio.Task[Result]] = []
    headers = {t: target.headers_for(t) for t in {s.tenant for s in specs}}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trace_configs=[trace]) as session:
        start = now()
        if on_start is not None:
            on_start(start)
        try:
            for spec in specs:
                body = spec.encode()
                result = Result(spec.index, target.name, spec.tenant, spec.request_class, spec.model, spec.kind,
                                spec.stream, spec.prompt_tokens, spec.max_tokens, spec.prefix_group, spec.arrival_s)
                results.append(result)
                delay = start + spec.arrival_s - now()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent = {**headers[spec.tenant], "x-request-id": f"{prefix}{spec.index}"}
                tasks.append(loop.create_task(send_one(session, body, target.url(spec.kind), sent, result, now,
                                                       start)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return results, [parse_cache_header(heads.get(spec.index)) for spec in specs]


class CacheBench:
    """The cache scenario's run: engines, one gateway, a warm-up, then both arms one after the other."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.duration_s = opts.duration_s or (QUICK_DURATION_S if opts.quick else DURATION_S)
        self.time_scale = opts.time_scale or TIME_SCALE
        self.rate = RATE * (opts.rate_multiplier or 1.0)
        self.questions = faq_questions(FAQ_QUESTIONS, opts.seed)
        self.arms: list[ArmRun] = []
        self.gateway_metrics = ""
        self.engine_metrics: list[str] = []

    def plan(self, salt: str) -> CacheWorkload:
        """The workload of an arm (same schedule for every ``salt``; ``chat`` texts differ)."""
        return build_workload(rate_per_s=self.rate, duration_s=self.duration_s, seed=self.ctx.options.seed,
                              questions=self.questions, salt=salt)

    async def counters(self, session: aiohttp.ClientSession) -> Counters:
        """The gateway's cache counters and the engines' finished requests, now."""
        texts = await asyncio.gather(scrape_text(session, self.gateway_metrics, SCRAPE_TIMEOUT_S),
                                     *(scrape_text(session, u, SCRAPE_TIMEOUT_S) for u in self.engine_metrics))
        return read_counters(texts[0], texts[1:])

    async def run_arm(self, arm: ArmRun, target: Target) -> None:
        """Drive one arm's load and read the counters around it."""
        sampler = MetricsSampler(self.engine_metrics, (RUNNING,))
        async with aiohttp.ClientSession() as session:
            arm.before = await self.counters(session)
            try:
                arm.results, arm.seen = await drive(arm.plan.workload, target, on_start=sampler.start)
            finally:
                await sampler.stop()
            await asyncio.sleep(SETTLE_S)  # the last answers' stores run just after they were sent
            arm.after = await self.counters(session)
        arm.series = {"engines running": sampler.series[RUNNING]}

    def warm_up(self, base_url: str, key: str) -> None:
        """A few requests of every kind (texts of their own, ``no-store``) before the measured load."""
        questions = faq_questions(2, self.ctx.options.seed + 1)
        specs = []
        kinds: tuple[tuple[Family, bool], ...] = (("chat", True), ("chat", False), ("faq", True), ("faq", False))
        for i, (family, stream) in enumerate(kinds):
            prompt: PromptText = (SynthText(((unique_key("cache-warmup", i), 300),), 0) if family == "chat"
                                  else LiteralText(questions.questions[i % 2].wordings[0]))
            labels = Labels(tenant=TENANT, request_class=family, model=MODELS[family], stream=stream,
                            extra_body={"temperature": 0, "ignore_eos": True})
            specs.append(RequestSpec(i, 0.2 * i, prompt, 8, labels))
        target = Target(base_url, "warmup", default_api_key=key, headers={CACHE_CONTROL_HEADER: "no-store"})
        results, _ = asyncio.run(drive(Workload(tuple(specs), 1.0, {"source": "warm-up"}), target))
        failed = [f"{r.status} {r.error_type}: {r.error_message}" for r in results if not r.ok]
        if failed:
            raise RuntimeError("the warm-up requests failed: " + "; ".join(failed))

    def run(self) -> None:
        """Start the engines and the gateway, warm up, run both arms, read the cache's gauges at the end."""
        ctx = self.ctx
        procs = ctx.procs
        *gen, emb = free_ports(REPLICAS + 1)
        policy = ctx.state_dir / "policies.yaml"
        policy.write_text(cache_policy(gen, emb, served_model=SERVED, embed_model=EMBED_SERVED, profile=PROFILE,
                                       kv_cache_tokens=KV_TOKENS, context_window=CONTEXT,
                                       min_similarity=MIN_SIMILARITY))
        ctx.say(f"cache: starting {REPLICAS} simulated replicas, an embeddings engine and the gateway")
        start_sims(procs, "cache-sims", policy, [*gen, emb], time_scale=self.time_scale, seed=ctx.options.seed)
        env = state_env(ctx.state_dir / "switchyard", policy)
        key = create_key(env, TENANT, TIER)
        gateway = start_gateway(procs, "cache-gateway", env)
        self.gateway_metrics = f"{gateway.base_url}/metrics"
        self.engine_metrics = [f"http://127.0.0.1:{p}/metrics" for p in gen]
        self.warm_up(gateway.base_url, key)
        cache_ended = time.monotonic()
        for name in ARMS:
            arm = ArmRun(name, self.plan("" if name == "cache" else name))
            headers = {} if name == "cache" else {CACHE_CONTROL_HEADER: BASELINE_CONTROL}
            ctx.say(f"cache: {name}: {len(arm.plan.workload)} requests over {self.duration_s:g} s")
            asyncio.run(self.run_arm(arm, Target(gateway.base_url, name, default_api_key=key, headers=headers)))
            self.arms.append(arm)
            if name == "cache":
                cache_ended = time.monotonic()
        # The entry and byte gauges are refreshed every few seconds: read them once a refresh has seen every store.
        time.sleep(max(0.0, cache_ended + GAUGE_REFRESH_S + 0.5 - time.monotonic()))

        async def gauges() -> Counters:
            async with aiohttp.ClientSession() as session:
                return await self.counters(session)

        end = asyncio.run(gauges())
        self.arms[0].after.entries, self.arms[0].after.bytes = end.entries, end.bytes
        procs.stop_all()


def run(ctx: ScenarioContext) -> Outcome:
    """Run the cache scenario and write its report into ``ctx.out_dir``."""
    started = time.monotonic()
    bench = CacheBench(ctx)
    bench.run()
    cache, base = bench.arms
    a = analyse(cache, base)
    goals = goals_of(a)
    tables = tables_of(a)
    qs = bench.questions
    bounds = repeat_bounds(cache.plan.items)
    traces = public_repeats(ctx.options.trace)
    hits = {r["family"]: r for r in a["hits"]}
    notes = [
        "Workload: synthetic, with Zipf-distributed repeats (exponent "
        f"{ZIPF_S:g}), not a trace replay: the public traces hold too few repeated prompts to measure a response "
        "cache in minutes (Mooncake, equal `hash_ids` lists: "
        + ("; ".join(traces) if traces else "the traces were not found here") + ").",
        f"{len(cache.results)} requests per arm at {bench.rate:g}/s over {bench.duration_s:g} s: "
        + ", ".join(f"{f} {100 * SHARES[f]:g}%" for f in FAMILIES)
        + f"; {100 * STREAM_SHARE:g}% streamed; {CHAT_ITEMS} chat prompts ({CHAT_PROMPT_TOKENS[0]}-"
        f"{CHAT_PROMPT_TOKENS[1]} tokens), {len(qs.questions)} FAQ questions, {100 * PARAPHRASE_SHARE:g}% of them "
        "reworded. Repeat fraction (the bound of the hit ratio): "
        f"chat {percent(bounds['chat'].exact)} (exact rule), faq {percent(bounds['faq'].semantic)} by question "
        f"({percent(bounds['faq'].exact)} by exact wording), the whole workload {percent(bounds['all'].exact)}.",
        f"FAQ wordings under the simulator's embedding: every pair of wordings of one question ≥ "
        f"{qs.paraphrase_min:.3f} cosine, every pair of different questions ≤ {qs.cross_max:.3f} "
        f"(the rule's min_similarity is {MIN_SIMILARITY:g}); {qs.dropped} rewordings dropped below "
        f"{PARAPHRASE_FLOOR:g}.",
        f"Arms on the same engines ({REPLICAS} replicas of `{PROFILE}` at time scale {bench.time_scale:g}, one "
        f"embeddings engine) and gateway, one after the other: `cache`, then `no-cache` (every request sends "
        f"`{CACHE_CONTROL_HEADER}: {BASELINE_CONTROL}`); the no-cache arm's chat prompts are other texts of the same "
        "lengths, so that it starts with cold engine prefix caches as the cache arm did.",
    ]
    if hits["sampled"]["hits"] or hits["sampled"].get("with_header"):
        notes.append(f"{hits['sampled']['hits']} sampled (temperature > 0) requests were answered from the cache and "
                     f"{hits['sampled'].get('with_header')} got a cache header: they should get neither.")
    failed = {arm.name: sum(not r.ok for r in arm.results) for arm in bench.arms}
    if any(failed.values()):
        notes.append("Failed requests: " + ", ".join(f"{k} {v}" for k, v in failed.items()) + ".")
    parameters = {"scenario": "cache", "rate": bench.rate, "duration_s": bench.duration_s,
                  "time_scale": bench.time_scale, "replicas": REPLICAS, "profile": PROFILE,
                  "min_similarity": MIN_SIMILARITY, "zipf_s": ZIPF_S, "shares": dict(SHARES),
                  "stream_share": STREAM_SHARE, "paraphrase_share": PARAPHRASE_SHARE,
                  "chat_items": CHAT_ITEMS, "faq_questions": len(qs.questions),
                  "paraphrase_min_cosine": qs.paraphrase_min, "cross_max_cosine": qs.cross_max,
                  "repeat_bound": {k: {"requests": b.requests, "repeats": b.repeats, "group_repeats": b.group_repeats}
                                   for k, b in bounds.items()},
                  "public_trace_repeats": traces, "wall_s": time.monotonic() - started}
    report = build_report({arm.name: arm.results for arm in bench.arms}, title="switchyard bench: cache "
                          "(response caches)", workload=cache.plan.workload, parameters=parameters,
                          seeds={"workload": ctx.options.seed, "engines": ctx.options.seed}, baseline=BASELINE,
                          tables=tables, goals=goals, notes=notes,
                          extra_series={arm.name: arm.series for arm in bench.arms})
    write_report(report, ctx.out_dir)
    speed = goals[0]["value"]
    summary = (f"exact {percent(hits['chat']['hit_ratio'])} hits ({percent(hits['chat']['of_bound'])} of the "
               f"{percent(hits['chat']['bound'])} bound), semantic {percent(hits['faq']['hit_ratio'])} "
               f"({percent(hits['faq']['of_bound'])} of {percent(hits['faq']['bound'])}); hits "
               + fixed(speed, decimals=0, unit="x") + " faster than misses (E2E p50); engines saved "
               f"{fixed(goals[-1]['value'], decimals=0)} requests")
    return Outcome("cache", "ok", summary, goals, tables[:2], "cache/report.md", notes=notes[:2])
