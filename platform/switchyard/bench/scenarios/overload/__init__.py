"""``overload``: flow control against plain FCFS, at twice what the engines can serve.

A main pool of ``MAIN_REPLICAS`` simulated replicas (``--max-num-seqs`` ``MAX_NUM_SEQS``, declared
as the pool's ``max_num_seqs``, priority scheduling on) serves model ``chat``; a small pool of one
replica serves ``chat-lite``, which ``chat`` downgrades its ``standard`` requests to when its own
pool is saturated (``on_saturation``). Three priority classes, best first: ``critical``,
``standard`` and ``sheddable`` (shed above a utilisation of ``SHED_ABOVE``), one tier each; in
every class a *noisy* tenant sends three requests out of four and a *quiet* one the fourth.

1. **Arms.** ``flow-control-on`` (the gateway's queues, deadlines, shedding, downgrades and engine
   priorities) and ``flow-control-off`` (``SWITCHYARD_FLOW_CONTROL=false`` and pools without
   ``priority_scheduling``: every request goes straight to the engines, which serve it first come,
   first served), one after the other, each on fresh engines and a fresh gateway (one database:
   the keys outlive the gateways). Each replica is its own ``switchyard sim --model`` process,
   started with the pool's ``--max-num-seqs``.
2. **Capacity.** Before each arm's load, its main pool's engines are called directly by a closed
   loop of ``MAX_NUM_SEQS`` clients per replica (every sequence slot busy, none waiting) sending
   requests of the workload's lengths back to back; completions per second after a warm-up are
   the pool's capacity. The first arm's sets the offered rate; the second's is a check, and gives
   both arms' engines the same warm-up.
3. **Load.** One seeded open-loop Poisson schedule of streaming requests at ``OVERLOAD`` times that
   capacity for the arm's duration, classes 20/40/40, the same for both arms. A request still
   unanswered after the client timeout is given up and counted as an error: nothing hangs.

Figures per arm and class: TTFT SLO attainment (``SLO_TTFT_S``; a failed request misses it),
goodput (requests and output tokens per second of the offered window that met it), shed,
downgraded and error rates, TTFT p50/p99, the noisy and the quiet tenant's attainment; the sheds
by reason (the error ``code``); the gateway's own counters and queue waits from its ``/metrics``.
A downgraded answer (``downgraded_from`` in ``x-switchyard-route``) counts as served: it met the
SLO if its first token came in time. Goals: critical attainment at least 99% with flow control
on; more goodput with flow control on than off; no error or hung request with flow control on
(a 503 with ``Retry-After`` is a clear, fast refusal, not an error).

The package, by responsibility: :mod:`.workload` (the classes, tenants and SLOs, the request mix and
the policy document), :mod:`.figures` (reading the results and the gateway's counters: the rows and
tables of the report) and :mod:`.scenario` (the run: capacity, both arms, goals and the report;
``run`` is what the scenario registry calls).

Must not touch: the gateway's or the simulator's internals. The scenario starts real processes
(``bench.procs``) and talks HTTP to them.
"""
