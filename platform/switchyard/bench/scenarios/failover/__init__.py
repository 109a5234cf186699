"""``failover`` (chaos): a region fails under steady interactive load, then comes back; twice, two ways.

Two regions of two simulated replicas each, one ``switchyard sim`` process per region, each with
its fault-injection control server (``--control-port``). Clients call ``chat-us`` or ``chat-eu``
(their home region, half each); each model falls back to the other region
(``bench.policies.two_region_policy``). A steady open-loop Poisson load of streaming interactive
requests runs throughout, in five phases (30 s each in a full run, a few seconds each with
``--quick``, ``--duration-s`` split evenly):

1. ``before``: both regions healthy;
2. ``down``: every us-east engine refuses connections (the control server's ``mode: down``: listening
   sockets closed, open keep-alive connections dropped), then is brought back (``mode: none``);
3. ``between``: both healthy again;
4. ``hang``: every us-east engine accepts inference requests and never answers a byte (``mode: hang``;
   ``/health`` still answers): only the gateway's first-token timeout (``resilience.first_token_timeout``,
   2 s here: these prompts' TTFT is tens of ms) and its breakers can tell;
5. ``after``: both healthy again.

The gateway runs with the policy's ``resilience`` defaults but for the first-token timeout.

Figures per outage: success rate of the requests sent during it (goal ≥ 99.9%, like the run's overall
success); *time to detect*: from the fault to the first token of the first us-east request served in
eu-west (a request that waited out the first-token timeout counts with its wait); *time to recover*:
from ``mode: none`` to the first token of the first us-east request served in us-east again; requests
that tried us-east first (``attempt=`` in the route header) or waited out the first-token timeout; and
*no retry storm*: endpoints tried per client request (route headers), the gateway's own counters
(``switchyard_upstream_attempts``, ``switchyard_fallbacks``, ``switchyard_retry_budget_exhausted``
deltas on its ``/metrics``), and how many requests the healthy region's engines received (finished,
running and waiting, from their ``/metrics``) against the client requests sent in the same window
(goal ≤ 1.2x). Per phase and home region: success, fallbacks, where requests were served, TTFT
p50/p90/p99/max. Every failed request is listed with how it failed.

The package, by responsibility: :mod:`.workload` (the regions, phases, outages and the request mix),
:mod:`.timeline` (the staged outages and the gateway's and the healthy engines' counters read at
their edges), :mod:`.analysis` (the figures per outage, per phase and home region, the load per phase,
the failed requests) and :mod:`.scenario` (the run: engines with fault control, the gateway, the load
and the outages staged under it, goals and the report; ``run`` is what the scenario registry calls).

Must not touch: the gateway's or the simulator's internals. The scenario starts real processes
(``bench.procs``) and talks HTTP to them (the faults through the simulator's control server).
"""
