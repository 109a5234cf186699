"""What a policy would do, before it serves: the pre-publish replay (``switchyard policy replay``).

Owns: replaying a workload (a trace, or a recorded mix of requests) against two policies (the
active one and a candidate) in simulated time, and the report of what changes between them:
where requests go, what they cost, which are refused, how fast they start, how much prompt is
served from cache.

How: every request runs the gateway's own decision procedure (``decide.procedure``), this package
being its executor on a simulated clock (``replay``, reading the fleet through ``view``): the same
resolution, admission, flow control, plan and pick, with each try answered by the simulator's engine
core (``sim.core.EngineCore``, one per endpoint, built from the pool's hardware profile and KV
capacity) driven by a discrete-event clock, so a replay runs as fast as the engine model can be
computed, not in wall-clock time.

Also the offline fit of the built-in difficulty classifier's weights (``whatif.difficulty_fit``):
like the replay, it runs the decisions' own code on bench's data.

A candidate can also be replayed as a canary (``whatif.canary``): it decides the requests of a slice (the
gateway's own hash, salted by the canary's id) and the active version the rest.

Workloads come from a trace file (bench's builders) or from the request log (``whatif.logged``,
read through the store by its callers' sessions).

Must not touch: the gateway or the network; the database only through a session its caller
gives. It imports ``decide``, ``state`` (queues and indexes of its own), ``policy``, ``sim``,
the workload builders of ``bench``, the in-process limit store (``store.limits``, driven on the
simulated clock) and the request log's table.
"""

from switchyard.whatif.canary import CanarySlice, ReplayCanary, Who
from switchyard.whatif.outcomes import ArmResult, ReplayOutcome
from switchyard.whatif.replay import replay_policy
from switchyard.whatif.report import compare_arms, render_report, replay_report

__all__ = ["ArmResult", "CanarySlice", "ReplayCanary", "ReplayOutcome", "Who", "compare_arms", "render_report",
           "replay_policy", "replay_report"]
