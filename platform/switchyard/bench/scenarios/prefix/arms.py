"""One arm of the prefix scenario: fresh simulated replicas, a gateway picking one way, the workload replayed.

Arms (``ARMS``), each on fresh engine processes (every cache starts empty) with the same requests at the
same times:

- ``precise``: the engines publish their KV-cache events (``switchyard sim --kv-events-config``), the pool
  declares ``kv_events``, the model names the simulator's tokenizer, and its endpoints are picked by the
  ``precise`` profile (``kv-cache-precise`` 0.6 + ``load`` 0.4: :data:`switchyard.bench.policies.PRECISE_SCORERS`).
- ``approximate``: today's default profile (``prefix-affinity`` on the gateway's approximate index + load).
- ``least-loaded``, ``round-robin``: the baselines (``SWITCHYARD_PICKER``).

Besides the engines' counters, every arm measures the gateway process's CPU over the replay; the precise arm
also reads the gateway's KV-event counters (batches and events applied, seconds spent decoding and applying
them) from its ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from switchyard.bench.loadgen import run_open_loop
from switchyard.bench.policies import TENANT, TIER, replicas_policy
from switchyard.bench.procs import StartError, cpu_seconds, engine_states, http_get
from switchyard.bench.results import Result
from switchyard.bench.sampler import MetricsSampler, sum_series
from switchyard.bench.scenarios.base import ScenarioContext
from switchyard.bench.sender import Target
from switchyard.bench.spec import Workload
from switchyard.bench.stack import create_key, start_gateway, start_sims, state_env
from switchyard.sim.config import EngineConfig

ARMS = ("precise", "approximate", "least-loaded", "round-robin")
#: The gateway's picking strategy per arm (the precise and approximate arms run the model's profile).
PICKER = {"precise": "prefix-aware", "approximate": "prefix-aware", "least-loaded": "least-loaded",
          "round-robin": "round-robin"}
REPLICAS = 8
PROFILE = "h100-8b"
MODEL = "chat"
SERVED = "sim-8b"
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running")
#: The gateway's KV-event counters (``gateway/metrics.py``, copied from the followers every
#: :data:`METRICS_EVERY_S`): events applied, and seconds spent decoding and applying them.
EVENTS = "switchyard_kv_events_total"
EVENT_SECONDS = "switchyard_kv_events_processing_seconds_total"
METRICS_EVERY_S = 1.0
#: The admin API's bearer token in the bench's gateways (loopback only, made afresh for each run).
ADMIN_TOKEN = secrets.token_urlsafe(16)


@dataclass
class ArmRun:
    """What one arm measured."""

    name: str
    results: list[Result] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0
    busy: float | None = None
    lag_s: float | None = None
    evictions: int = 0
    preemptions: int = 0
    per_endpoint: Counter[str] = field(default_factory=Counter)
    series: dict[str, list[float]] = field(default_factory=dict)
    #: Wall seconds of the replay (first send to last answer), and the gateway's CPU seconds over it.
    elapsed_s: float = 0.0
    gateway_cpu_s: float | None = None
    #: The simulated engines' process's CPU seconds over the replay (publishing events costs it too).
    sims_cpu_s: float | None = None
    #: The gateway's KV-event counters over the replay (None: it exposes none).
    events: float | None = None
    event_batches: float | None = None
    event_seconds: float | None = None
    #: Each engine's event stream at the end of the replay, as the gateway's admin API shows it (precise arm).
    streams: list[dict[str, Any]] | None = None

    @property
    def hit_ratio(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    @property
    def gateway_cpu(self) -> float | None:
        """The gateway's CPU over the replay, as a share of one core."""
        return self.gateway_cpu_s / self.elapsed_s if self.gateway_cpu_s is not None and self.elapsed_s else None

    @property
    def sims_cpu(self) -> float | None:
        """The engines' process's CPU over the replay, as a share of one core."""
        return self.sims_cpu_s / self.elapsed_s if self.sims_cpu_s is not None and self.elapsed_s else None

    @property
    def events_per_s(self) -> float | None:
        return self.events / self.elapsed_s if self.events is not None and self.elapsed_s else None

    @property
    def events_cpu(self) -> float | None:
        """Seconds spent on events per second of the replay: the share of one core."""
        return self.event_seconds / self.elapsed_s if self.event_seconds is not None and self.elapsed_s else None


def port_block(count: int, tries: int = 200) -> int:
    """The first of ``count`` consecutive ports free on every interface (the engines' event sockets bind
    ``*``, and engine N of a sim process publishes on its configured port + N)."""
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(20_000, 60_000 - count)
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise StartError(f"no {count} consecutive free ports")


def _counters(ports: Sequence[int]) -> tuple[float, float]:
    hits = queries = 0.0
    for port in ports:
        text_ = http_get(f"http://127.0.0.1:{port}/metrics").decode()
        hits += sum_series(text_, HITS)
        queries += sum_series(text_, QUERIES)
    return hits, queries


def _event_counters(base_url: str, token: str) -> tuple[float, float, float] | None:
    """The gateway's KV-event counters: events and batches applied (its admin API, current) and seconds spent
    on them (its metrics, as of their last copy); None where it shows none."""
    try:
        text_ = http_get(f"{base_url}/metrics").decode()
    except OSError:
        return None
    streams = _event_streams(base_url, token)
    if EVENT_SECONDS not in text_ or streams is None:
        return None
    return (float(sum(s.get("events") or 0 for s in streams)), float(sum(s.get("batches") or 0 for s in streams)),
            sum_series(text_, EVENT_SECONDS))


def run_arm(ctx: ScenarioContext, name: str, workload: Workload, *, label: str, kv_tokens: int, context: int,
            time_scale: float, key_box: dict[str, str]) -> ArmRun:
    """Run arm ``name`` on ``workload`` (``label`` names its processes and files)."""
    procs = ctx.procs
    base = port_block(3 * REPLICAS)
    ports = list(range(base, base + REPLICAS))
    precise = name == "precise"
    policy = ctx.state_dir / f"policies-{label}-{name}.yaml"
    policy.write_text(replicas_policy(ports, model=MODEL, served_model=SERVED, profile=PROFILE,
                                      kv_cache_tokens=kv_tokens, context_window=context,
                                      kv_events=(REPLICAS, 2 * REPLICAS) if precise else None))
    extra: list[str] = []
    if precise:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{base + REPLICAS}",
                  "replay_endpoint": f"tcp://127.0.0.1:{base + 2 * REPLICAS}"}
        extra = ["--kv-events-config", json.dumps(config)]
    ctx.say(f"prefix: {label}: {name}: starting {REPLICAS} simulated replicas and the gateway")
    sims = start_sims(procs, f"prefix-sims-{label}-{name}", policy, ports, time_scale=time_scale,
                      seed=ctx.options.seed, extra=extra)
    env = {**state_env(ctx.state_dir / "switchyard", policy), "SWITCHYARD_PICKER": PICKER[name],
           "SWITCHYARD_UPSTREAM_READ_TIMEOUT_S": "300", "SWITCHYARD_ADMIN_TOKEN": ADMIN_TOKEN}
    if "key" not in key_box:  # one database for every arm: the key outlives the gateways
        key_box["key"] = create_key(env, TENANT, TIER)
    gateway = start_gateway(procs, f"prefix-gateway-{label}-{name}", env)
    arm = ArmRun(name)
    if precise and not _wait_live(gateway.base_url, ADMIN_TOKEN):
        ctx.say(f"prefix: {label}: precise: the gateway did not follow every engine's events live before the replay")
    before = engine_states(ports)
    events0 = _event_counters(gateway.base_url, ADMIN_TOKEN) if precise else None
    sampler = MetricsSampler([f"http://127.0.0.1:{p}/metrics" for p in ports], SERIES)
    cpu0, sims0 = cpu_seconds(gateway.proc.pid), cpu_seconds(sims.pid)
    wall = time.monotonic()

    async def drive() -> list[Result]:
        try:
            return await run_open_loop(workload, Target(gateway.base_url, name, default_api_key=key_box["key"]),
                                       progress=ctx.options.progress, timeout_s=300.0, on_start=sampler.start)
        finally:
            await sampler.stop()

    ctx.say(f"prefix: {label}: {name}: replaying {len(workload)} requests over {workload.duration_s:.0f} s")
    arm.results = asyncio.run(drive())
    arm.elapsed_s = time.monotonic() - wall
    cpu1, sims1 = cpu_seconds(gateway.proc.pid), cpu_seconds(sims.pid)
    arm.gateway_cpu_s = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    arm.sims_cpu_s = sims1 - sims0 if sims0 is not None and sims1 is not None else None
    events1 = _event_counters(gateway.base_url, ADMIN_TOKEN) if precise else None
    if events1 is not None:  # the metrics' next copy holds the replay's last events
        until = time.monotonic() + METRICS_EVERY_S + 0.5
        while time.monotonic() < until:
            time.sleep(0.25)
            later = _event_counters(gateway.base_url, ADMIN_TOKEN)
            if later is not None and later[2] != events1[2]:
                events1 = (events1[0], events1[1], later[2])
                break
    if events0 is not None and events1 is not None:
        arm.events, arm.event_batches, arm.event_seconds = (b - a for a, b in zip(events0, events1, strict=True))
    arm.hits, arm.queries = _counters(ports)
    after = engine_states(ports)
    busy = [a.get("busy_s", 0.0) - b.get("busy_s", 0.0) for a, b in zip(after, before, strict=True)]
    arm.busy = sum(busy) / (len(ports) * arm.elapsed_s * time_scale) if arm.elapsed_s > 0 else None
    arm.lag_s = max((a.get("lag_s") or 0.0 for a in after), default=None)
    arm.evictions = sum(int(a.get("kv_evictions", 0)) for a in after)
    arm.preemptions = sum(int(a.get("preemptions", 0)) for a in after)
    if precise:
        arm.streams = _event_streams(gateway.base_url, ADMIN_TOKEN)
    arm.per_endpoint = Counter(r.route_fields.get("endpoint", "-") for r in arm.results if r.ok)
    arm.series = {"engine queue (waiting)": sampler.series[SERIES[0]],
                  "engine running": sampler.series[SERIES[1]]}
    procs.stop(gateway.proc)
    procs.stop(sims)
    return arm


def _event_streams(base_url: str, token: str) -> list[dict[str, Any]] | None:
    """Each endpoint's KV-event stream as the gateway follows it (``/admin/api/endpoints``), None if unreadable."""
    request = urllib.request.Request(f"{base_url}/admin/api/endpoints",  # noqa: S310 - loopback only
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5.0) as answer:  # noqa: S310
            data = json.loads(answer.read())
    except (OSError, ValueError):
        return None
    rows = data.get("endpoints") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        return None
    return [r.get("kv_events") or {} for r in rows if isinstance(r, dict)]


def _wait_live(base_url: str, token: str, timeout_s: float = 15.0) -> bool:
    """Wait until the gateway follows every engine's events live, or the timeout (an arm that starts before then
    routes its first requests by the approximate index, as a gateway would). Whether they all were."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        streams = _event_streams(base_url, token)
        if streams and all(s.get("state") == "live" for s in streams):
            return True
        time.sleep(0.2)
    return False


def replica_config(kv_tokens: int, context: int, seed: int) -> EngineConfig:
    """One replica as the arms' policy has ``switchyard sim --policy`` start it (for the offline oracle)."""
    return EngineConfig(served_model=SERVED, port=0, profile=PROFILE, kv_cache_tokens=kv_tokens,
                        max_model_len=context, seed=seed)
