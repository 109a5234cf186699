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

The package, by responsibility: :mod:`.workload` (the mix of request kinds and the two policy
documents the run alternates), :mod:`.figures` (the processes' resources read from ``/proc``, the
RSS trend, the tally of what each kind got) and :mod:`.scenario` (the run: the load, the readings
and the policy rewrites under it, goals and the report; ``run`` is what the scenario registry calls).

Must not touch: the gateway's or the simulator's internals. The scenario starts real processes
(``bench.procs``) and talks HTTP to them; it reads their resources from ``/proc``.
"""
