"""The scenarios of ``switchyard bench``, one flag each.

Landed: ``headline`` (a day of mixed traffic on fixed capacity, Switchyard against round-robin and least-loaded
balancers: goodput at SLO, attainment per class and tenant, utilisation, the batch backlog, a region's
outage; not among the defaults yet), ``overhead`` (the gateway's added latency and throughput against calling the engine
directly and against LiteLLM), ``prefix`` (precise KV-event routing against the approximate
index, least-loaded, round-robin and an oracle, on a trace replay and agent sessions), ``overload``
(flow control against plain FCFS at twice the engines' capacity: per-class TTFT SLO attainment,
goodput, shed and downgrade rates),
``failover`` (alias ``chaos``: a region's engines refusing connections, killed mid-stream, then hung
mid-stream, under steady load), ``reload`` (publishes and rollbacks under load: propagation to another
replica, failed and mis-versioned requests), ``auto``
(a labelled easy/hard prompt set through a gateway on the demo policy: where the ``auto`` route
sent each, the difficulty classifier's accuracy, cost per 1,000 requests against all on large),
``cache`` (the exact and semantic response caches on a workload with Zipf-distributed repeats and
paraphrases: hit ratio against the repeat bound, hit latency p50/p99 against misses and against
the same gateway told to skip the cache, engine requests saved, entries and bytes), ``batch``
(interactive load at half the pool's capacity with and without a large batch through the Batch API:
the batch lane's share of the idle capacity, interactive TTFT p50/p99 against the run without it),
``soak`` (a steady mixed load with streams, hang-ups, refusals, cache hits and policy rewrites for
``--duration`` seconds: the gateway's memory over time and its trend, and every unexpected error), ``canary``
(policy canaries under steady load: a harmless candidate promoted through its steps, a costly one rolled back by
the guards; the requests it decided first and the time to its rollback), ``adapters`` (LoRA adapter-aware picking
against least-loaded on one pool serving many adapters: the engines' adapter loads per 1,000 requests, requests
deferred for an adapter slot, TTFT).

Not landed (none at present): scenarios whose feature does not exist yet. They are listed with
the issue that brings the feature, and every report names them instead of showing a figure.

Must not touch: the gateway's or the simulator's internals. Scenarios start real processes
(``bench.procs``) and talk HTTP to them.
"""

from __future__ import annotations

from switchyard.bench.scenarios import overhead, prefix, reload
from switchyard.bench.scenarios.adapters import scenario as adapters_scenario
from switchyard.bench.scenarios.auto import scenario as auto_scenario
from switchyard.bench.scenarios.base import BenchOptions, Outcome, Scenario, ScenarioContext
from switchyard.bench.scenarios.batch import scenario as batch_scenario
from switchyard.bench.scenarios.cache import scenario as cache_scenario
from switchyard.bench.scenarios.canary import scenario as canary_scenario
from switchyard.bench.scenarios.failover import scenario as failover_scenario
from switchyard.bench.scenarios.headline import scenario as headline_scenario
from switchyard.bench.scenarios.overload import scenario as overload_scenario
from switchyard.bench.scenarios.soak import scenario as soak_scenario

SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in (
        Scenario("headline", "a day of mixed traffic on fixed capacity (diurnal load to 1.5x, a batch backlog, a "
                 "region down): goodput at SLO against round-robin and least-loaded", headline_scenario.run),
        Scenario("overhead", "gateway overhead: added latency and max requests/s vs direct and LiteLLM",
                 overhead.run),
        Scenario("prefix", "precise KV-event routing vs the approximate index, least-loaded, round-robin and an "
                 "oracle, on a trace replay and agent sessions", prefix.run),
        Scenario("overload", "flow control vs plain FCFS at twice capacity: per-class SLO attainment, goodput, "
                 "shedding and downgrades", overload_scenario.run),
        Scenario("failover", "resilience (chaos): a region's engines down, killed mid-stream, then hung, under "
                 "load; answers complete, detection, longest wait, no retry storm", failover_scenario.run),
        Scenario("cache", "response caches: hit ratio against the repeat bound and hit latency p50/p99 on a "
                 "workload with repeats and paraphrases, vs the same gateway without the cache", cache_scenario.run),
        Scenario("batch", "the Batch API filling idle capacity without hurting interactive traffic: the batch "
                 "lane's share of the idle capacity, interactive TTFT with and without a batch", batch_scenario.run),
        Scenario("reload", "policy lifecycle: publishes and rollbacks under load on two replicas", reload.run),
        Scenario("auto", "routing cheap requests to cheap models: the auto route on a labelled prompt set, "
                 "cost per 1,000 requests vs all-large", auto_scenario.run),
        Scenario("soak", "a steady mixed load (streams, hang-ups, errors, cache hits, policy rewrites) for "
                 "--duration seconds: the gateway's RSS trend and unexpected errors", soak_scenario.run),
        Scenario("canary", "policy canaries under load: a good candidate promoted through its steps, a bad one "
                 "rolled back; requests it decided and time to the rollback", canary_scenario.run),
        Scenario("adapters", "LoRA adapter-aware picking vs least-loaded on one pool serving many adapters: adapter "
                 "loads per 1,000 requests, requests deferred for a slot, TTFT", adapters_scenario.run),
    )
}
#: Other names of a scenario: ``--scenario chaos`` runs ``failover`` (its report keeps that name).
SCENARIOS["chaos"] = SCENARIOS["failover"]
#: What ``switchyard bench`` runs when no ``--scenario`` is given. ``overload`` is left out: its two
#: arms of 30 s (the FCFS one draining for up to its 15 s client timeout) add nearly two minutes.
DEFAULT_SCENARIOS = ("overhead", "prefix", "failover", "auto")

__all__ = ["DEFAULT_SCENARIOS", "SCENARIOS", "BenchOptions", "Outcome", "Scenario", "ScenarioContext"]
