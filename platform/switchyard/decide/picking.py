"""What the endpoint picker's plugins see and what they must be.

The candidates with what the executor knows of each (:class:`Option`), the request at one pick
(:class:`PickRequest`, and the :class:`Subject` its stateful scorers key their memory on), and the
interfaces: a :class:`Filter` keeps candidates, a :class:`Scorer` scores them in [0, 1], a
:class:`Picker` chooses one, and an :class:`Observer` (a plugin that keeps state) is told what was
picked and what became of it. The plugins themselves are :mod:`switchyard.decide.plugins`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from switchyard.decide.prefix import block_hashes, prompt_text
from switchyard.decide.sessions import session_key
from switchyard.decide.views import NO_MEMORY, EndpointView, ScorerMemory
from switchyard.policy.fleet import Pool

#: A model's request → the token ids its engine will see and cache (None: it cannot say exactly).
PromptRenderer = Callable[[Mapping[str, Any]], "list[int] | None"]


@dataclass(slots=True)
class Option:
    """A candidate endpoint and its view."""

    pool: Pool
    url: str
    view: EndpointView


@dataclass(slots=True, eq=False)
class Subject:
    """What stateful scorers key their memory on: the request's prompt and who sent it.

    The prompt's block hashes are computed on first use (only profiles that score prefix affinity
    among more than one endpoint need them) and kept for the request's later picks and hooks.
    """

    body: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    tenant: str = ""
    #: The executor's prompt renderers by model (what the precise KV-cache scorer looks up).
    renderers: Mapping[str, PromptRenderer] = field(default_factory=dict)
    _hashes: list[bytes] | None = None
    _tokens: dict[str, list[int] | None] = field(default_factory=dict)
    #: What the precise KV-cache scorer scored each endpoint by, at its last pick: (True, tokens cached) from
    #: the engine's report, or (False, share of the prompt's blocks) from the approximate index.
    cache_sources: dict[str, tuple[bool, float]] = field(default_factory=dict)
    #: Session keys already made, by (header, use_user, model): scored, then recorded.
    _sessions: dict[tuple[str, bool, str], str | None] = field(default_factory=dict)

    def session(self, header: str, use_user: bool, model: str) -> str | None:
        """The request's session key for ``model`` (:func:`switchyard.decide.sessions.session_key`), made once."""
        key = (header, use_user, model)
        if key not in self._sessions:
            self._sessions[key] = session_key(header, use_user, self.headers, self.body, self.tenant, model)
        return self._sessions[key]

    def tokens(self, model: str) -> list[int] | None:
        """The prompt's token ids as ``model``'s engine will see them, made once per model (None: no renderer
        for it, or the request cannot be rendered exactly)."""
        if model not in self._tokens:
            render = self.renderers.get(model)
            self._tokens[model] = render(self.body) if render is not None else None
        return self._tokens[model]

    def cannot_render(self, model: str) -> bool:
        """Whether there is no renderer for ``model``, or it could not render this request (without rendering
        it now)."""
        return model not in self.renderers or (model in self._tokens and self._tokens[model] is None)

    def hashes(self) -> list[bytes]:
        """The prompt's chained block hashes (:func:`switchyard.decide.prefix.block_hashes`)."""
        if self._hashes is None:
            self._hashes = block_hashes(prompt_text(self.body))
        return self._hashes


@dataclass(slots=True)
class PickRequest:
    """What the plugins know of the request at one pick.

    Attributes:
        memory: The stateful scorers' memory (the executor's).
        subject: What they key it on.
        model: The model of the plan's stage being picked for.
        alternatives: How many endpoints that stage has (with one, affinity cannot matter).
        home_region: The region it prefers (None: no preference).
        ceiling: The utilisation under which its class is dispatched (1.0, batch lane less).
        rotation: A counter for round-robin.
        rng: Breaks ties (None: the first of the tied candidates, for reproducible dry runs).
        now: The executor's clock.
        adapter: The LoRA adapter the model is (its served name; None: a base model).
    """

    memory: ScorerMemory = NO_MEMORY
    subject: Subject = field(default_factory=Subject)
    model: str = ""
    alternatives: int = 1
    home_region: str | None = None
    ceiling: float = 1.0
    rotation: int = 0
    rng: random.Random | None = None
    now: float = 0.0
    adapter: str | None = None


#: What became of a request at the endpoint it was sent to: answered, preempted by flow control (it
#: ran there for a while), or failed before answering.
Answer = Literal["ok", "preempted", "failed"]


@runtime_checkable
class Filter(Protocol):
    """Keeps the candidates it passes."""

    @property
    def name(self) -> str: ...

    def keep(self, options: Sequence[Option], request: PickRequest) -> list[Option]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores each candidate in [0, 1]."""

    @property
    def name(self) -> str: ...

    @property
    def weight(self) -> float:
        """How much its score counts in the profile's weighted mean."""
        ...

    def score(self, options: Sequence[Option], request: PickRequest) -> list[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses one candidate by its score."""

    @property
    def name(self) -> str: ...

    def pick(self, options: Sequence[Option], scores: Sequence[float], request: PickRequest) -> int: ...


@runtime_checkable
class Explains(Protocol):
    """A scorer that says, for the decision trace, what it scored the chosen endpoint by."""

    def explain(self, url: str, request: PickRequest) -> str | None: ...


@runtime_checkable
class Observer(Protocol):
    """A plugin that keeps state: told what was picked and what became of it."""

    def picked(self, url: str, request: PickRequest) -> None:
        """``url`` was chosen for the request (before it is sent)."""
        ...

    def answered(self, url: str, request: PickRequest, answer: Answer) -> None:
        """The request's try at ``url`` ended as ``answer``."""
        ...
