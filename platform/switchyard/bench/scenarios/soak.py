"""``soak``: a steady mixed load for a long time, watching the gateway's memory and every failure.

One gateway (``switchyard serve``, embedded defaults: SQLite and in-process counters, or the
PostgreSQL and Redis of ``SWITCHYARD_DATABASE_URL`` / ``SWITCHYARD_REDIS_URL`` when set) over a pool
of simulated engines gets an open-loop Poisson load of a fixed mix for ``--duration`` seconds
(default 300; the issue's check is ``--duration 1800``):

- chats and text completions answered whole, and streamed chats read to ``[DONE]``;
- streamed chats the client hangs up on after the first event (the gateway must cancel the engine's
  request and release the reservation);
- deterministic repeats of a few prompts that the policy's exact cache rule answers (cache hits);
- a tenant on a tier with a small token limit (429s, each releasing nothing it did not take);
- bad requests: invalid JSON (400), an unknown model (404), no key (401);
- and every ``reload_every`` seconds the policy file is rewritten (two documents in turn), so the
  gateway validates, records and activates a new version under load.

Every few seconds the scenario reads the gateway's resident memory (``VmRSS``), threads and open
file descriptors from ``/proc`` (and the engines' memory, for comparison). After a warm-up (the
first third of the run: the prefix index and caches fill to their age bounds) a least-squares line through
the gateway's RSS gives its trend; the goal is no growing trend: the line's rise over the steady part
at most 3% of the median RSS (or 4 MiB, whichever is larger). Each request's status is checked
against what its kind must get; anything else (a 5xx, a dropped connection, a timeout, a stream
without ``[DONE]``, a 200 where a refusal was due) is an unexpected error, and the goal is zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from switchyard.bench.loadgen import send_one
from switchyard.bench.policies import PRIORITY, TENANT, TIER
from switchyard.bench.procs import create_key, free_ports, http_get, start_gateway, start_sims, state_env
from switchyard.bench.prompts import segment_text, unique_key
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.tables import goal, num, table, text

RATE = 30.0
DURATION_S = 300.0
QUICK_DURATION_S = 12.0
SAMPLE_EVERY_S = 5.0
QUICK_SAMPLE_EVERY_S = 0.5
RELOAD_EVERY_S = 20.0
QUICK_RELOAD_EVERY_S = 3.0
TIME_SCALE = 10.0
ENGINES = 2
PROFILE = "h100-8b"
SERVED = "sim-8b"
#: Share of the run left out of the trend, while state that is bounded by age fills to its bound: the prefix
#: index remembers 10 minutes of traffic (``decide.prefix``), the response cache 2 (this policy's TTL), and
#: connection pools and the request log's buffer fill too. A third of a 30-minute run covers the longest.
WARMUP_SHARE = 1 / 3
#: The goal: the RSS trend's rise over the steady part at most this share of the median RSS ...
GROWTH_SHARE = 0.03
#: ... or this many MiB, whichever is larger (allocator noise on a small process).
GROWTH_FLOOR_MIB = 4.0
REQUEST_TIMEOUT_S = 30.0
#: Distinct prompts the cache-repeat kind cycles through (each is a miss once, then hits until its TTL).
CACHED_PROMPTS = 40
LIMITED_TENANT = "soak-limited"
LIMITED_TIER = "limited"


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of request in the soak's mix.

    Attributes:
        name: Its label in the report.
        weight: Relative frequency.
        expected: The statuses it may get; anything else is an unexpected error.
    """

    name: str
    weight: float
    expected: frozenset[int]


MIX = (
    Kind("chat", 28, frozenset({200})),
    Kind("stream", 22, frozenset({200})),
    Kind("abandoned stream", 10, frozenset({200})),
    Kind("cache repeat", 15, frozenset({200})),
    Kind("completion", 5, frozenset({200})),
    Kind("over limit", 8, frozenset({200, 429})),
    Kind("bad JSON", 4, frozenset({400})),
    Kind("unknown model", 4, frozenset({404})),
    Kind("no key", 4, frozenset({401})),
)


def soak_policy(ports: Sequence[int], *, queue_ms: int) -> str:
    """One pool of simulated engines, an exact cache rule for ``chat``, and a tier with a small limit.

    ``queue_ms`` tells the two documents the scenario alternates apart (each write is a new version).
    """
    urls = ", ".join(f"http://127.0.0.1:{p}" for p in ports)
    return f"""\
schema: 1
regions: [local]
pools:
  - {{name: soak, region: local, served_model: {SERVED}, endpoints: [{urls}],
      kv_cache_tokens: 100000, sim_profile: {PROFILE}}}
models:
  - {{name: chat, pools: [soak], context_window: 8192, price: {{input_per_mtok: 0, output_per_mtok: 0}}}}
priorities:
  {PRIORITY}: {{max_queue_ms: {queue_ms}}}
tiers:
  - {{name: {TIER}, priority: {PRIORITY}, models: ["*"]}}
  - {{name: {LIMITED_TIER}, priority: {PRIORITY}, models: ["*"], limits: {{tokens_per_minute: 3000}}}}
cache:
  - {{name: exact, match: {{models: [chat]}}, ttl: 2m}}
"""


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of the processes' resources.

    Attributes:
        t_s: Seconds since the load began.
        rss_mib: The gateway's resident memory.
        threads: The gateway's threads.
        fds: The gateway's open file descriptors.
        engines_rss_mib: The simulated engines' process's resident memory.
        requests: Requests finished so far.
        unexpected: Unexpected errors so far.
    """

    t_s: float
    rss_mib: float
    threads: int
    fds: int
    engines_rss_mib: float
    requests: int
    unexpected: int


def cache_hits(exposition: str) -> float:
    """The gateway's response-cache hits so far, from its ``/metrics``."""
    return sum(sample.value for family in text_string_to_metric_families(exposition)
               if family.name == "switchyard_cache_lookups" for sample in family.samples
               if sample.name.endswith("_total") and sample.labels.get("result") == "hit")


def _proc_status(pid: int) -> tuple[float, int]:
    """``(VmRSS in MiB, threads)`` of a process, from ``/proc``."""
    rss_kib, threads = 0.0, 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = float(line.split()[1])
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss_kib / 1024, threads


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def trend(samples: Sequence[Sample], warmup_s: float) -> dict[str, Any]:
    """The gateway's RSS trend after the warm-up: slope, rise over the steady part, and the goal's verdict."""
    steady = [s for s in samples if s.t_s >= warmup_s]
    if len(steady) < 3:
        return {"samples": len(steady), "slope_mib_per_h": None, "rise_mib": None, "median_mib": None,
                "allowed_mib": None, "met": None, "first_mib": None, "last_mib": None, "max_mib": None}
    t = np.array([s.t_s for s in steady])
    rss = np.array([s.rss_mib for s in steady])
    slope, _ = np.polyfit(t, rss, 1)
    span = float(t[-1] - t[0])
    rise = float(slope) * span
    median = float(np.median(rss))
    allowed = max(GROWTH_SHARE * median, GROWTH_FLOOR_MIB)
    third = max(1, len(steady) // 3)
    return {"samples": len(steady), "steady_from_s": float(t[0]), "steady_to_s": float(t[-1]),
            "slope_mib_per_h": float(slope) * 3600, "rise_mib": rise, "median_mib": median,
            "allowed_mib": allowed, "met": rise <= allowed, "first_mib": float(np.mean(rss[:third])),
            "last_mib": float(np.mean(rss[-third:])), "max_mib": float(rss.max()),
            "fds_first": steady[0].fds, "fds_last": steady[-1].fds, "fds_max": max(s.fds for s in steady),
            "threads_first": steady[0].threads, "threads_last": steady[-1].threads}


@dataclass
class Tally:
    """What each kind of request got."""

    sent: Counter[str] = field(default_factory=Counter)
    expected: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[tuple[str, str]] = field(default_factory=Counter)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)

    @property
    def finished(self) -> int:
        return sum(self.expected.values()) + sum(self.unexpected.values())

    @property
    def unexpected_total(self) -> int:
        return sum(self.unexpected.values())


class Soak:
    """The soak scenario's run."""

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.duration_s = opts.duration_s or (QUICK_DURATION_S if opts.quick else DURATION_S)
        self.sample_every_s = QUICK_SAMPLE_EVERY_S if opts.quick else SAMPLE_EVERY_S
        self.reload_every_s = QUICK_RELOAD_EVERY_S if opts.quick else RELOAD_EVERY_S
        self.time_scale = opts.time_scale or TIME_SCALE
        self.rng = random.Random(opts.seed)
        self.tally = Tally()
        self.samples: list[Sample] = []
        self.results: list[Result] = []
        self.reloads_written = 0
        self.reloads_applied = 0
        self.reload_failures: list[str] = []
        self.versions: list[str] = []
        self.cache_hits = 0.0
        self.database = os.environ.get("SWITCHYARD_DATABASE_URL", "")
        self.redis = os.environ.get("SWITCHYARD_REDIS_URL", "")

    def run(self) -> None:
        ctx = self.ctx
        ports = free_ports(ENGINES)
        self.ports = ports
        self.policy = ctx.state_dir / "policies.yaml"
        self.policy.write_text(soak_policy(ports, queue_ms=2000))
        env = state_env(ctx.state_dir / "switchyard", self.policy)
        if self.database:
            env["SWITCHYARD_DATABASE_URL"] = self.database
        if self.redis:
            env["SWITCHYARD_REDIS_URL"] = self.redis
        self.engines = start_sims(ctx.procs, "soak-sims", self.policy, ports, time_scale=self.time_scale,
                                  seed=ctx.options.seed)
        self.key = create_key(env, TENANT, TIER)
        self.limited_key = create_key(env, LIMITED_TENANT, LIMITED_TIER)
        self.gateway = start_gateway(ctx.procs, "soak-gateway", env)
        ctx.say(f"soak: {self.duration_s:.0f} s of {RATE:g} requests/s (mixed), the policy rewritten every "
                f"{self.reload_every_s:g} s, resources read every {self.sample_every_s:g} s")
        asyncio.run(self._drive())

    def _request(self, kind: Kind, i: int) -> tuple[bytes, dict[str, str], str, bool]:
        """``(body, headers, path, stream)`` of the ``i``-th request, of ``kind``."""
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"}
        prompt_tokens = self.rng.randint(40, 300)
        max_tokens = self.rng.randint(4, 32)
        words = segment_text(unique_key("soak", i), prompt_tokens)
        chat: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": words}],
                                "max_tokens": max_tokens}
        stream = kind.name in ("stream", "abandoned stream")
        path = "/v1/chat/completions"
        if stream:
            chat["stream"] = True
        if kind.name == "cache repeat":
            n = self.rng.randrange(CACHED_PROMPTS)
            chat = {"model": "chat", "temperature": 0, "max_tokens": 16,
                    "messages": [{"role": "user", "content": segment_text(unique_key("soak-cached", n), 120)}]}
        elif kind.name == "completion":
            path = "/v1/completions"
            chat = {"model": "chat", "prompt": words, "max_tokens": max_tokens}
        elif kind.name == "over limit":
            headers["Authorization"] = f"Bearer {self.limited_key}"
            chat["max_tokens"] = 64
        elif kind.name == "unknown model":
            chat["model"] = "no-such-model"
        elif kind.name == "no key":
            del headers["Authorization"]
        elif kind.name == "bad JSON":
            return b'{"model": "chat", "messages": [', headers, path, False
        return json.dumps(chat).encode(), headers, path, stream

    async def _one(self, session: aiohttp.ClientSession, kind: Kind, i: int, scheduled_s: float,
                   start: float) -> None:
        body, headers, path, stream = self._request(kind, i)
        url = self.gateway.base_url + path
        result = Result(index=i, arm="soak", tenant=TENANT, request_class=kind.name, model="chat",
                        kind="completion" if path.endswith("/completions") and "chat" not in path else "chat",
                        stream=stream, prompt_tokens_sent=0, max_tokens=0, prefix_group=None,
                        scheduled_s=scheduled_s)
        if kind.name == "abandoned stream":
            await self._abandon(session, url, body, headers, result, start)
        else:
            await send_one(session, body, url, headers, result, time.monotonic, start)
        self._count(kind, result)
        if kind.name in ("chat", "stream", "completion", "cache repeat"):
            self.results.append(result)

    async def _abandon(self, session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                       result: Result, start: float) -> None:
        """Open a stream, read its first event, and hang up."""
        result.sent_s = time.monotonic() - start
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                response = await session.post(url, data=body, headers=headers)
                result.status = response.status
                if response.status == 200:
                    line = await response.content.readline()
                    if not line.startswith(b"data:"):
                        result.error_type = "bad_response"
                    else:
                        result.first_token_s = time.monotonic() - start
                response.close()  # drops the connection mid-stream
        except TimeoutError:
            result.timed_out = True
        except aiohttp.ClientError as exc:
            result.error_type = "connection_error"
            result.error_message = f"{type(exc).__name__}: {exc}"[:200]
        result.done_s = time.monotonic() - start

    def _count(self, kind: Kind, result: Result) -> None:
        tally = self.tally
        tally.statuses[(kind.name, result.status)] += 1
        good = result.status in kind.expected and not result.timed_out and (
            result.status != 200 or result.error_type is None)
        if good:
            tally.expected[kind.name] += 1
        else:
            why = ("timeout" if result.timed_out else
                   f"{result.status} {result.error_type or ''}".strip() if result.status else
                   result.error_type or "no response")
            tally.unexpected[(kind.name, why)] += 1

    async def _drive(self) -> None:
        weights = [k.weight for k in MIX]
        arrivals: list[tuple[float, Kind]] = []
        at = 0.0
        while True:
            at += self.rng.expovariate(RATE)
            if at >= self.duration_s:
                break
            arrivals.append((at, self.rng.choices(MIX, weights)[0]))
        for kind in MIX:
            self.tally.sent[kind.name] = sum(1 for _, k in arrivals if k is kind)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = time.monotonic()
            watch = asyncio.create_task(self._watch(start))
            reload = asyncio.create_task(self._reloads(session, start))
            tasks: set[asyncio.Task[None]] = set()
            for i, (due, kind) in enumerate(arrivals):
                delay = start + due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(self._one(session, kind, i, due, start))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks)
            reload.cancel()
            watch.cancel()
            for background in (reload, watch):
                with contextlib.suppress(asyncio.CancelledError):
                    await background
            self._sample(time.monotonic() - start)
        self.cache_hits = cache_hits(http_get(f"{self.gateway.base_url}/metrics").decode())

    def _sample(self, t_s: float) -> None:
        rss, threads = _proc_status(self.gateway.proc.pid)
        engines_rss, _ = _proc_status(self.engines.pid)
        self.samples.append(Sample(t_s, rss, threads, _open_fds(self.gateway.proc.pid), engines_rss,
                                   self.tally.finished, self.tally.unexpected_total))

    async def _watch(self, start: float) -> None:
        while True:
            self._sample(time.monotonic() - start)
            await asyncio.sleep(self.sample_every_s)

    def _version(self) -> str:
        ready = json.loads(http_get(f"{self.gateway.base_url}/readyz"))
        return str(ready["checks"]["policy"]["version"])

    async def _reloads(self, session: aiohttp.ClientSession, start: float) -> None:
        """Rewrite the policy file every ``reload_every_s`` and wait (≤ 5 s) until the gateway serves it."""
        n = 0
        while True:
            await asyncio.sleep(self.reload_every_s)
            n += 1
            before = await asyncio.to_thread(self._version)
            self.policy.write_text(soak_policy(self.ports, queue_ms=2000 + n % 2))
            self.reloads_written += 1
            deadline = time.monotonic() + 5.0
            while True:
                now = await asyncio.to_thread(self._version)
                if now != before:
                    self.reloads_applied += 1
                    self.versions.append(now)
                    break
                if time.monotonic() > deadline:
                    self.reload_failures.append(f"rewrite {n} at {time.monotonic() - start:.0f} s: still {before}")
                    break
                await asyncio.sleep(0.05)


def run(ctx: ScenarioContext) -> Outcome:
    """Run the soak scenario and write its report into ``ctx.out_dir``."""
    s = Soak(ctx)
    started = time.monotonic()
    s.run()
    warmup_s = WARMUP_SHARE * s.duration_s
    t = trend(s.samples, warmup_s)
    tally = s.tally
    alive = s.gateway.proc.alive()
    mib = "MiB"
    memory = table(
        "Gateway resources over the run",
        [text("what", "what"), num("first", "steady start", 1), num("last", "steady end", 1),
         num("max", "max", 1), text("note", "note")],
        [{"what": f"RSS ({mib}, mean of the steady part's first and last third)", "first": t["first_mib"],
          "last": t["last_mib"], "max": t["max_mib"],
          "note": (f"trend {t['slope_mib_per_h']:+.2f} MiB/h, i.e. {t['rise_mib']:+.2f} MiB over the steady part"
                   if t["slope_mib_per_h"] is not None else "too few samples")},
         {"what": "open file descriptors", "first": t.get("fds_first"), "last": t.get("fds_last"),
          "max": t.get("fds_max"), "note": "sockets to clients, engines and the database included"},
         {"what": "threads", "first": t.get("threads_first"), "last": t.get("threads_last"),
          "max": max((x.threads for x in s.samples), default=None), "note": ""}],
        f"{len(s.samples)} readings every {s.sample_every_s:g} s; the first {warmup_s:.0f} s are warm-up and left "
        "out of the trend.")
    rows = []
    for kind in MIX:
        got = ", ".join(f"{status or 'none'}: {n}" for (name, status), n in sorted(tally.statuses.items())
                        if name == kind.name)
        bad = ", ".join(f"{why}: {n}" for (name, why), n in sorted(tally.unexpected.items()) if name == kind.name)
        rows.append({"kind": kind.name, "sent": tally.sent[kind.name], "expected": "/".join(map(str, sorted(
            kind.expected))), "got": got, "unexpected": sum(n for (name, _), n in tally.unexpected.items()
                                                          if name == kind.name), "which": bad})
    outcomes = table("Requests by kind", [text("kind", "kind"), num("sent", "sent", 0),
                                          text("expected", "must get"), text("got", "statuses"),
                                          num("unexpected", "unexpected", 0), text("which", "unexpected ones")],
                     rows, "An abandoned stream counts as expected when its first event arrived before the hang-up.")
    goals = [
        goal("gateway RSS: no growing trend", f"rise ≤ max({GROWTH_SHARE:.0%} of median, {GROWTH_FLOOR_MIB:g} MiB)",
             t["rise_mib"], t["met"], unit="MiB", decimals=2,
             note=(f"median {t['median_mib']:.1f} MiB, allowed {t['allowed_mib']:.1f} MiB; "
                   f"{t['slope_mib_per_h']:+.2f} MiB/h" if t["median_mib"] is not None else "too few samples")),
        goal("unexpected errors", "0", tally.unexpected_total, tally.unexpected_total == 0, decimals=0,
             note=f"of {tally.finished} requests"),
        goal("policy rewrites served", f"{s.reloads_written}", s.reloads_applied,
             s.reloads_applied == s.reloads_written and not s.reload_failures, decimals=0,
             note="; ".join(s.reload_failures[:3]) or "each new version served within 5 s"),
        goal("gateway alive at the end", "yes", 1 if alive else 0, alive, decimals=0),
    ]
    notes = [f"{RATE:g} requests/s for {s.duration_s:.0f} s over {ENGINES} `{PROFILE}` engines at time scale "
             f"{s.time_scale:g}; database: {'PostgreSQL' if s.database.startswith('postgresql') else 'SQLite'}; "
             f"limits and caches: {'Redis' if s.redis else 'in-process'}.",
             f"Response-cache hits (the gateway's own count): {s.cache_hits:.0f}, for "
             f"{sum(1 for r in s.results if r.request_class == 'cache repeat')} cache repeats sent."]
    parameters = {"scenario": "soak", "rate": RATE, "duration_s": s.duration_s, "time_scale": s.time_scale,
                  "sample_every_s": s.sample_every_s, "reload_every_s": s.reload_every_s,
                  "wall_s": time.monotonic() - started, "mix": {k.name: k.weight for k in MIX}}
    report = build_report({"soak": s.results}, title="switchyard bench: soak (memory and errors under a long "
                          "mixed load)", parameters=parameters, seeds={"workload": ctx.options.seed},
                          tables=[memory, outcomes], goals=goals, notes=notes, bin_s=max(1.0, s.duration_s / 300))
    report["samples"] = [{"t_s": x.t_s, "rss_mib": x.rss_mib, "threads": x.threads, "fds": x.fds,
                          "engines_rss_mib": x.engines_rss_mib, "requests": x.requests,
                          "unexpected": x.unexpected} for x in s.samples]
    report["trend"] = t
    write_report(report, ctx.out_dir)  # with the memory plot (bench.plots.memory_over_time)
    summary = (f"{tally.finished} requests, {tally.unexpected_total} unexpected; gateway RSS "
               f"{t['first_mib'] or 0:.1f} → {t['last_mib'] or 0:.1f} MiB "
               f"({t['slope_mib_per_h'] or 0:+.2f} MiB/h) over {s.duration_s:.0f} s")
    return Outcome("soak", "ok", summary, goals, [memory, outcomes], "soak/report.md", notes=notes)
