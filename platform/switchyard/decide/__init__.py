"""The decisions, as pure functions of (policy snapshot, request features, observed state).

Owns: which model a request resolves to, whether the tier may call it, which endpoint serves
it, and the trace of why. Must not touch: I/O of any kind (network, database, clock, globals);
it imports ``policy`` only. The gateway, the policy tests and the console's dry-run all call
these same functions, so they cannot drift apart.
"""
