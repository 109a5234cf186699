"""The ``soak`` scenario's run: engines and a gateway, the mixed load for ``--duration`` seconds with the
resource readings and the policy rewrites under it, then the goals and the report (what the scenario registry
calls is :func:`run`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from typing import Any

import aiohttp

from switchyard.bench.policies import TENANT, TIER
from switchyard.bench.procs import free_ports, http_get
from switchyard.bench.prompts import segment_text, unique_key
from switchyard.bench.report import build_report, write_report
from switchyard.bench.results import Result
from switchyard.bench.scenarios.base import Outcome, ScenarioContext
from switchyard.bench.scenarios.soak.figures import (
    GROWTH_FLOOR_MIB,
    GROWTH_SHARE,
    WARMUP_SHARE,
    Sample,
    Tally,
    cache_hits,
    open_fds,
    proc_status,
    trend,
)
from switchyard.bench.scenarios.soak.workload import (
    CACHED_PROMPTS,
    LIMITED_TENANT,
    LIMITED_TIER,
    MIX,
    PROFILE,
    Kind,
    soak_policy,
)
from switchyard.bench.sender import send_one
from switchyard.bench.stack import create_key, start_gateway, start_sims, state_env
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
REQUEST_TIMEOUT_S = 30.0


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
        rss, threads = proc_status(self.gateway.proc.pid)
        engines_rss, _ = proc_status(self.engines.pid)
        self.samples.append(Sample(t_s, rss, threads, open_fds(self.gateway.proc.pid), engines_rss,
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
