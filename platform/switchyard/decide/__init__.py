"""The decisions, and the one ordered procedure that makes them for every executor.

Owns: which model a request resolves to and whether its tier may call it (``resolve``), where it
may go and would rather go (``regions``), its class (``classes``), the response cache's plan
(``cache``), whether it fits its model and what it reserves against which limits (``admit``), flow
control's go / downgrade / shed / queue and who gives way to whom (``flow``), the fallback plan and
the endpoint picked by the model's profile of plugins (``pick``, ``picking``, ``plugins``), and
the order of all of them: the procedure (``procedure``, over a ``decision``), which the gateway,
the dry-run and the policy tests (``dryrun``, ``policy_tests``) and the what-if replay execute.

Must not touch: I/O of any kind (network, database, files, clocks) or state that changes: what the
decisions read of the world comes through the read-only views an executor hands in (``views``),
and the state of the stateful scorers is the executor's, written only through the scorers' own
observation hooks. It imports ``policy`` only, and the header names of ``api.headers`` (the request
headers its decisions read).
"""
