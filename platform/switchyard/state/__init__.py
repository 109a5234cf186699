"""Mutable state that decisions read: flow control's queues, the prefix and session indexes.

Owns: data structures that change as requests come and go, each owned by an executor of the
decision procedure (a gateway process, a replay arm). Decisions (:mod:`switchyard.decide`) read
them only through the read-only views and memory protocols declared in
:mod:`switchyard.decide.views`; stateful scorers write their own state through their observation
hooks. Must not touch: I/O of any kind, any clock (time is passed in), or any switchyard package
but ``policy``.
"""
