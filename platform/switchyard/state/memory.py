"""The stateful scorers' memory of one executor: which endpoints hold which prompt blocks (guessed, and as the
engines report it), and which endpoint served each session last (a :class:`switchyard.decide.views.ScorerMemory`)."""

from __future__ import annotations

from switchyard.state.kvindex import EngineCaches
from switchyard.state.prefix import PrefixIndex
from switchyard.state.sessions import SessionIndex


class Memory:
    """One prefix index, one session index and the engines' caches as their events report them, owned by a
    gateway process or a replay arm."""

    def __init__(self) -> None:
        self.prefixes = PrefixIndex()
        self.sessions = SessionIndex()
        self.engine_caches = EngineCaches()
