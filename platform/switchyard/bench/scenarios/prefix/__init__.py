"""``prefix``: precise KV-event routing against the approximate index, least-loaded and round-robin, an
oracle and the unbounded bound, on two workloads (see :mod:`~switchyard.bench.scenarios.prefix.run`)."""

from switchyard.bench.scenarios.prefix.oracle import unbounded_bound
from switchyard.bench.scenarios.prefix.run import run
from switchyard.bench.scenarios.prefix.workloads import default_trace

__all__ = ["default_trace", "run", "unbounded_bound"]
