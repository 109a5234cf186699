"""``canary``: policy canaries under steady load: a harmless candidate is promoted through its steps, a costly one
is rolled back by the guards, and how much traffic the costly one decided first.

Three simulated engines (two of an 8B model, ``small``; one of a 70B model, ``large``, priced about 9x) and two
gateway replicas sharing SQLite (``policy_source=db``); a couple of hundred tenants with a key each, spread over
three tiers, each tier its own priority class. A steady open-loop Poisson load of mixed requests (short answers,
short streams, long-prompt streams that the ``chat`` route sends to ``large``) is spread evenly over the tenants
and both replicas, and runs while two canaries are started through replica A's admin API
(``POST /admin/api/policy/canary``) and followed (``GET``, every 0.25 s):

1. a **good** candidate, a harmless change (the cache rule's lifetime), steps 5% → 25% → 50%: it must be promoted;
2. a **bad** candidate that sends every request to ``large`` (cost about 4x the rest's, a slower first token),
   steps 1% → 10% → 50%: the guards must roll it back.

Figures, per canary: its outcome, its steps (their times from the status' ``step_started_at``) and the traffic
each served; how many requests it decided (answers whose ``x-switchyard-route`` names its version) while it ran,
as a share of all requests sent in that time, and after its end; the time from its start to its end; the
reason; both sides' figures as the canary compared them and as the clients saw them. Goals (the issue's): the
good candidate promoted; the bad one rolled back within two minutes, having decided at most 2% of the requests.

The package: :mod:`.policy` (fleet, tenants, the documents; the keys come from one run of
``switchyard keys create-many``), :mod:`.figures` (figures, tables, goals) and :mod:`.scenario` (the run;
``run`` is what the registry calls).

Must not touch: the gateway's or the simulator's internals. The scenario starts real processes and talks HTTP.
"""
