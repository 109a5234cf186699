"""The stateful scorers' memory of one executor: which endpoints hold which prompt blocks, and which endpoint
served each session last (a :class:`switchyard.decide.views.ScorerMemory`)."""

from __future__ import annotations

from switchyard.state.prefix import PrefixIndex
from switchyard.state.sessions import SessionIndex


class Memory:
    """One prefix index and one session index, owned by a gateway process or a replay arm."""

    def __init__(self) -> None:
        self.prefixes = PrefixIndex()
        self.sessions = SessionIndex()
