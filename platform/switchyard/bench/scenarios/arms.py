"""What the scenarios that run their arms on fresh simulated engines share (``overload``, ``batch``).

Each arm, one after the other: start its engines (fresh ones, on new ports) and write its policy;
create the keys while the first arm's gateway starts (one database: the keys outlive the
gateways), or just start the gateway; wait for the engines; measure the pool's capacity with a
closed loop calling its engines directly (every sequence slot busy, none waiting), the first arm's
setting the offered rate of one seeded Poisson schedule, the same for every arm; offer the load;
stop what the arm started.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import aiohttp

from switchyard.bench.procs import Proc, Processes, wait_http
from switchyard.bench.results import Result
from switchyard.bench.scenarios.base import ScenarioContext
from switchyard.bench.sender import Target, send_one
from switchyard.bench.spec import RequestSpec, Workload
from switchyard.bench.stack import GatewayHandle, create_keys, run_cli, start_gateway, state_env, switchyard_command
from switchyard.bench.synthetic import RequestTemplate, poisson
from switchyard.bench.tables import ms, num, table, text

TIME_SCALE = 1.0
DURATION_S = 30.0
CAPACITY_WARMUP_S = 1.0
CAPACITY_S = 4.0
QUICK_CAPACITY_WARMUP_S = 0.5
QUICK_CAPACITY_S = 2.0
#: A request unanswered after this long is given up (an error): a user has left by then.
CLIENT_TIMEOUT_S = 15.0
QUICK_CLIENT_TIMEOUT_S = 10.0


# --- capacity ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the closed loop measured on a pool.

    Attributes:
        clients: Clients sending back to back (every sequence slot of the pool).
        window_s: The measuring window (after the warm-up).
        completed: Successful requests that ended in the window.
        failed: Failed requests that ended in the window.
        rps: Successful completions per second of the window: the capacity.
        output_tps: Output tokens per second of those.
        e2e_mean_s: Their mean end-to-end time.
    """

    clients: int
    window_s: float
    completed: int
    failed: int
    rps: float
    output_tps: float
    e2e_mean_s: float | None


async def measure_capacity(ports: Sequence[int], specs: Sequence[RequestSpec], *, clients_per_engine: int,
                           warmup_s: float, duration_s: float, timeout_s: float,
                           api_key: str | None = None) -> Capacity:
    """``clients_per_engine`` clients per port, each sending the next of ``specs`` when its last ends (with
    ``api_key``, when the port is a gateway's).

    Requests that end inside ``[warmup_s, warmup_s + duration_s)`` are counted.
    """
    loop = asyncio.get_running_loop()
    now = loop.time
    order = itertools.count()
    window: list[Result] = []
    clients = clients_per_engine * len(ports)
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        start = now()
        begin, end = warmup_s, warmup_s + duration_s

        async def client(port: int) -> None:
            target = Target(f"http://127.0.0.1:{port}", "capacity", default_api_key=api_key)
            while now() - start < end:
                spec = specs[next(order) % len(specs)]
                result = Result(spec.index, target.name, spec.tenant, spec.request_class, spec.model, spec.kind,
                                spec.stream, spec.prompt_tokens, spec.max_tokens, spec.prefix_group, now() - start)
                headers = {**target.headers_for(spec.tenant), **spec.labels.headers}
                await send_one(session, spec.encode(), target.url(spec.kind), headers, result, now, start)
                if begin <= result.done_s < end:
                    window.append(result)

        await asyncio.gather(*(client(port) for port in ports for _ in range(clients_per_engine)))
    ok = [r for r in window if r.ok]
    return Capacity(clients, duration_s, len(ok), len(window) - len(ok), len(ok) / duration_s,
                    sum(r.output_tokens for r in ok) / duration_s,
                    sum(r.e2e_s for r in ok) / len(ok) if ok else None)


def combined(parts: Sequence[Capacity]) -> Capacity:
    """The capacity of several pools measured side by side over the same window: their sums (the mean request
    time weighted by completions)."""
    completed = sum(p.completed for p in parts)
    e2e = sum(p.e2e_mean_s * p.completed for p in parts if p.e2e_mean_s is not None)
    return Capacity(sum(p.clients for p in parts), max(p.window_s for p in parts), completed,
                    sum(p.failed for p in parts), sum(p.rps for p in parts), sum(p.output_tps for p in parts),
                    e2e / completed if completed else None)


def capacity_table(arms: Sequence[Arm], *, title: str, tps_label: str, first_use: str, note: str
                   ) -> dict[str, Any]:
    """The table of every arm's capacity measurement (the first one's ``use`` is ``first_use``)."""
    rows = []
    for i, arm in enumerate(arms):
        c = arm.capacity
        if c is None:
            continue
        rows.append({"arm": arm.name, "clients": c.clients, "completed": c.completed, "failed": c.failed,
                     "rps": c.rps, "output_tps": c.output_tps, "e2e_mean_s": c.e2e_mean_s,
                     "use": first_use if i == 0 else "a check (and the same warm-up)"})
    return table(
        title,
        [text("arm", "engines of"), num("clients", "clients", 0), num("completed", "completed", 0),
         num("failed", "failed", 0), num("rps", "capacity req/s", 2), num("output_tps", tps_label, 0),
         ms("e2e_mean_s", "mean request ms", 0), text("use", "use")],
        rows, note)


# --- engines ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What every simulated replica of a scenario is started with (``--max-num-seqs`` is the pool's)."""

    profile: str
    max_num_seqs: int
    kv_cache_tokens: int
    max_model_len: int


def start_engine(procs: Processes, name: str, port: int, served: str, shape: EngineShape, *, seed: int,
                 time_scale: float) -> Proc:
    """Start one simulated replica (``switchyard sim --model``: ``--max-num-seqs`` is the pool's)."""
    return procs.start(name, [*switchyard_command(), "sim", "--model", served, "--port", str(port),
                              "--profile", shape.profile, "--max-num-seqs", str(shape.max_num_seqs),
                              "--kv-cache-tokens", str(shape.kv_cache_tokens),
                              "--max-model-len", str(shape.max_model_len),
                              "--time-scale", f"{time_scale:g}", "--seed", str(seed)])


def wait_engines(engines: Mapping[int, Proc]) -> None:
    """Wait until every engine answers ``/health``."""
    for port, proc in engines.items():
        wait_http(f"http://127.0.0.1:{port}/health", proc, 60)


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Arm:
    """What one arm measured (a scenario's arms add their own figures)."""

    name: str
    capacity: Capacity | None = None
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass
class Stack:
    """One arm's processes: its engines (by port) and its gateway.

    Attributes:
        name: The arm.
        pool: The ports of the pool whose capacity is measured (and whose engines are sampled).
        engines: Every engine of the arm, by port.
        gateway: The arm's gateway, once started.
    """

    name: str
    pool: list[int]
    engines: dict[int, Proc]
    gateway: GatewayHandle | None = None


ArmT = TypeVar("ArmT", bound=Arm)


class FreshArms(ABC, Generic[ArmT]):
    """A run of ``arm_names`` one after the other, each on fresh engines and a fresh gateway.

    A scenario sets the class attributes and writes :meth:`start_engines`, :meth:`tenants`,
    :meth:`mix` and :meth:`load`.
    """

    #: Names the processes and starts the progress lines.
    scenario: str
    arm_names: tuple[str, ...]
    arm_type: type[ArmT]
    #: How the progress lines name the pool whose capacity is measured.
    pool: str
    #: The model the load calls, and the name the engines serve (the capacity loop calls them directly).
    model: str
    served: str
    shape: EngineShape
    #: The offered rate, as a multiple of the first arm's capacity (requests per second).
    load_factor: float
    quick_duration_s: float
    #: Seconds per arm without ``--quick`` or ``--duration``.
    duration_default_s: float = DURATION_S
    #: Measure every arm's capacity (a check of the first's); False: the first arm's only.
    measure_every_arm: bool = True

    def __init__(self, ctx: ScenarioContext) -> None:
        self.ctx = ctx
        opts = ctx.options
        self.duration_s = opts.duration_s or (self.quick_duration_s if opts.quick else self.duration_default_s)
        self.time_scale = opts.time_scale or TIME_SCALE
        self.timeout_s = QUICK_CLIENT_TIMEOUT_S if opts.quick else CLIENT_TIMEOUT_S
        self.capacity_warmup_s = QUICK_CAPACITY_WARMUP_S if opts.quick else CAPACITY_WARMUP_S
        self.capacity_s = QUICK_CAPACITY_S if opts.quick else CAPACITY_S
        self.workload: Workload | None = None
        self.keys: dict[str, str] = {}
        self.arms: list[ArmT] = []

    @property
    def capacity(self) -> Capacity | None:
        """The capacity the offered rate is set from (measured on the first arm's engines)."""
        return self.arms[0].capacity if self.arms else None

    @abstractmethod
    def start_engines(self, name: str) -> Stack:
        """Start an arm's engines (fresh ones, on new ports) and write its policy; nothing waited for."""

    @abstractmethod
    def tenants(self) -> list[tuple[str, str]]:
        """The tenants that get a key, each with its tier."""

    @abstractmethod
    def mix(self, model: str) -> list[RequestTemplate]:
        """The offered requests, calling ``model``."""

    @abstractmethod
    def load(self, stack: Stack, arm: ArmT, workload: Workload) -> None:
        """Offer ``workload`` to the arm's gateway and record what came of it in ``arm``."""

    def policy_path(self, name: str) -> Path:
        return self.ctx.state_dir / f"policies-{name}.yaml"

    def engine(self, name: str, port: int, served: str) -> Proc:
        """Start one simulated replica of the scenario's shape."""
        return start_engine(self.ctx.procs, name, port, served, self.shape, seed=self.ctx.options.seed,
                            time_scale=self.time_scale)

    def env(self, name: str) -> dict[str, str]:
        """The settings of an arm's Switchyard processes (one database for all: the keys outlive gateways)."""
        return state_env(self.ctx.state_dir / "switchyard", self.policy_path(name))

    def start_gateway(self, stack: Stack) -> None:
        stack.gateway = start_gateway(self.ctx.procs, f"{self.scenario}-gateway-{stack.name}", self.env(stack.name))

    def create_keys(self, stack: Stack) -> None:
        """A key per tenant, all in one ``keys create-many``, while the first arm's gateway starts."""
        env = self.env(stack.name)
        run_cli(["db", "upgrade"], env)
        with ThreadPoolExecutor(1) as pool:
            made = pool.submit(create_keys, env, self.tenants())
            self.start_gateway(stack)
            self.keys = made.result()

    def measure(self, stack: Stack) -> Capacity:
        """The pool's capacity: its engines called directly by a closed loop over every sequence slot."""
        specs = poisson(100.0, 10.0, self.mix(self.served), self.ctx.options.seed + 1,
                        max_model_len=self.shape.max_model_len).specs
        self.ctx.say(f"{self.scenario}: {stack.name}: measuring the {self.pool}'s capacity "
                     f"({self.shape.max_num_seqs * len(stack.pool)} clients, {self.capacity_s:g} s)")
        capacity = asyncio.run(measure_capacity(stack.pool, specs, clients_per_engine=self.shape.max_num_seqs,
                                                warmup_s=self.capacity_warmup_s, duration_s=self.capacity_s,
                                                timeout_s=self.timeout_s))
        if capacity.completed == 0:
            raise RuntimeError(f"{stack.name}: the capacity measurement completed no request")
        return capacity

    def stop(self, stack: Stack) -> None:
        if stack.gateway is not None:
            self.ctx.procs.stop(stack.gateway.proc)
        for proc in stack.engines.values():
            self.ctx.procs.stop(proc)

    def run(self) -> None:
        for name in self.arm_names:
            stack = self.start_engines(name)
            if not self.keys:
                self.create_keys(stack)  # and the gateway, meanwhile
            else:
                self.start_gateway(stack)
            wait_engines(stack.engines)
            arm = self.arm_type(name)
            self.arms.append(arm)
            # Every arm's engines get the same closed loop first (or the first arm's only); the first arm's sets
            # the offered load.
            if self.workload is None or self.measure_every_arm:
                arm.capacity = self.measure(stack)
            if self.workload is None:
                assert arm.capacity is not None
                self.workload = self.workload_for(arm.capacity)
            self.load(stack, arm, self.workload)
            self.stop(stack)

    def workload_for(self, capacity: Capacity) -> Workload:
        """The load every arm is offered, from the first arm's capacity: Poisson arrivals of :meth:`mix` at
        ``load_factor`` times it."""
        return poisson(self.load_factor * capacity.rps, self.duration_s, self.mix(self.model), self.ctx.options.seed,
                       max_model_len=self.shape.max_model_len)
