"""``failover`` (chaos): a region fails under steady interactive load, then comes back; three times, three ways.

Two regions of two simulated replicas each, one ``switchyard sim`` process per region, each with its
fault-injection control server (``--control-port``). Clients call ``chat-us`` or ``chat-eu`` (their home
region, half each); each model falls back to the other region (``bench.policies.two_region_policy``). The
tier's class has a time-to-first-token objective of 1 s (so a first-token deadline of 2 s, for streams and
complete answers alike) and hedges streams whose first token is later than the pool's observed p95; the
gateway runs with the policy's ``resilience`` defaults otherwise (hang detection after 1 s, streams resumed
on another endpoint, retry budget 20% + 3/s). A steady open-loop Poisson load of interactive requests runs
throughout: 20 a second, half streamed (64-256 output tokens: many streams are mid-answer at any moment),
half complete answers (16-64 tokens, so their wait is mostly their time to first token), ``ignore_eos``. Seven
phases (30 s each in a full run, a few seconds each with ``--quick``, ``--duration`` split evenly):

1. ``before``: both regions healthy;
2. ``down``: every us-east engine refuses connections (the control server's ``mode: down``: listening sockets
   closed, open connections dropped, streams in flight included), then is brought back (``mode: none``);
3. ``between-1``: both healthy again;
4. ``kill``: the us-east simulator process (both engines and their control server) is SIGKILLed while streams
   run on it, and started again on the same ports at the phase's end (empty caches, counters from zero);
5. ``between-2``: both healthy again;
6. ``hang``: the us-east engines stall (``mode: hang``): running streams stop mid-answer, new requests are
   accepted and get nothing, their counters freeze and ``/health`` stays 200: only the gateway's hang
   detection, first-token deadlines and breakers can tell;
7. ``after``: both healthy again.

A fault waits, if it must, until the gateway has had the region back in service for 2 s (its engines carry
traffic again and have been seen busy and moving), and then lasts its whole phase; the phases are the ones
the run staged (their edges are recorded), and the load's schedule does not move.

Figures per outage, of its requests (sent while it lasted, and those in flight when it began): answered
completely (2xx, a ``finish_reason``, no error event, a stream ended with ``[DONE]``); streams broken, resumed
and hedged (the gateway's counters at the outage's edges, and its request log, ``GET /admin/api/requests``, read
every 5 s with the admin token the bench gives it); *time to detect*: from the fault to the gateway taking the
us-east engines out of service (``GET /admin/api/endpoints`` polled every 0.1 s: their health and breakers,
and ``switchyard_endpoint_hangs_total``) and to the first token of the first us-east request served in eu-west;
*traffic moved*: the last request sent during the outage that tried a us-east engine first (``moved_on`` in its
route header), from the fault; recovery (us-east back in service, then serving again); the longest client wait
(a stream's first token, a complete answer's whole time: an upper bound of its wait; from the scheduled time)
and the longest gap inside a stream. Over the run: engine requests per client request (what both regions'
engines received: finished, running, waiting and abandoned requests, from their ``/metrics`` and
``/sim/state``, the killed process's count added to its successor's) with the gateway's attempts, hedges,
resumes and exhausted retry budget; per phase, the same load and, per home region, success, fallbacks, where
requests were served and TTFT. Every request not answered completely is listed, as the client saw it and as
the gateway's request log recorded it.

Goals (the issue's): ≥ 99.99% of requests answered completely in each outage phase; the hang detected (every
us-east engine out of service) and traffic moved off us-east within 2 s; no client waiting longer than the
class's deadline plus 1 s (3 s); at most 1.2 engine requests per client request over the run.

The package, by responsibility: :mod:`.workload` (the regions, phases, outages, the class's objective and hedge,
and the request mix), :mod:`.timeline` (the staged outages, the counters read at their edges, the endpoints'
changes and the request log seen), :mod:`.watch` (the gateway's admin API polled while the load runs),
:mod:`.phases` (what one result says, the phases, the figures per phase), :mod:`.analysis` (the figures per
outage and over the run, the failures), :mod:`.report` (tables, goals, notes, the summary line) and
:mod:`.scenario` (the run: engines with fault control, the gateway, the load and the outages staged under it;
``run`` is what the scenario registry calls).

Must not touch: the gateway's or the simulator's internals. The scenario starts real processes
(``bench.procs``), talks HTTP to them (the faults through the simulator's control server) and signals them.
"""
