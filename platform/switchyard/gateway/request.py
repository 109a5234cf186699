"""A request on its way through the gateway: its ids, and what it carries to the engines."""

from __future__ import annotations

import asyncio
import functools
import itertools
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request

from switchyard.decide.cache import RequestKind
from switchyard.decide.decision import Decision
from switchyard.gateway.admission import NO_LEASE, Lease
from switchyard.gateway.tracing import OFF, RequestTrace
from switchyard.policy.fleet import Pool
from switchyard.state.queues import Ticket
from switchyard.store.keys import KeyIdentity

if TYPE_CHECKING:
    from switchyard.engines.streams import Resume
    from switchyard.gateway.response_cache import Lookup
    from switchyard.policy.fleet import Model

Kind = RequestKind
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class RequestIds:
    """Unique ids without a system call per request: a random per-process prefix and a counter.

    (``uuid4()`` reads the OS's random source on every call; on the hot path it cost about as
    much as the whole routing decision.)
    """

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:12]
        self._counter = itertools.count(1)

    def new(self) -> str:
        """A fresh id, unique across processes and restarts."""
        return f"{self._prefix}{next(self._counter):x}"

    def for_request(self, headers: Mapping[str, str]) -> str:
        """The caller's ``x-request-id`` when it is sane, else a fresh one."""
        given = headers.get("x-request-id")
        return given if given and _REQUEST_ID.match(given) else self.new()


@dataclass(frozen=True, slots=True)
class Incoming:
    """What a request brings, from a client (:meth:`from_http`) or from Switchyard itself (a batch line).

    ``identity``: already known (internal callers); None: authenticate the ``authorization`` header.
    ``disconnected``: returns when the caller has gone (never, for internal callers).
    ``batch``: a line of a batch job, charged at the model's batch price.
    """

    headers: Mapping[str, str]
    raw: bytes
    disconnected: Callable[[], Awaitable[None]]
    identity: KeyIdentity | None = None
    batch: bool = False

    @classmethod
    async def from_http(cls, request: Request[Any, Any, Any]) -> Incoming:
        return cls(request.headers, await request.body(), functools.partial(client_left, request.receive))


async def client_left(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    """Returns when the client has gone (its body has been read: the next ASGI message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def never() -> None:
    """An internal caller never goes away."""
    await asyncio.Event().wait()


@dataclass(slots=True)
class LegUsage:
    """What one engine did for a request (a streamed answer has one leg per engine that produced part of it)."""

    model: Model
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class PendingRequest:
    """A request on its way to an engine: what each of its tries carries, and its body encoded per kind of pool.

    Attributes:
        decision: Its run of the decision procedure (class, estimate, plan, tries so far).
        lease: Its reservation against its limits, settled once when it ends.
        ticket: A queue's grant, until the request counts itself at its endpoint.
        cache: What the response cache said (None: no cache rule applies).
        force_usage: Ask the engine for a usage chunk the client did not ask for (to store the stream; the
            relay leaves the chunk out of what the client gets).
        batch: A batch job's line: charged at the model's batch price.
        trace: Its trace spans (:data:`~switchyard.gateway.tracing.OFF` when tracing is off).
        resume: Continues its stream after a break (the relay's hook; None: a broken stream just ends).
        continuation: The body a resumed stream's next try sends (None: the request's own), and
            ``continued_tokens``: the tokens of the answer so far that it carries.
        legs: What each engine that produced part of a streamed answer did, as each part ends.
    """

    kind: Kind
    body: dict[str, Any]
    raw: bytes
    stream: bool
    rid: str
    started: float
    identity: KeyIdentity
    decision: Decision
    lease: Lease = field(default_factory=lambda: NO_LEASE)
    ticket: Ticket | None = None
    cache: Lookup | None = None
    force_usage: bool = False
    batch: bool = False
    trace: RequestTrace = OFF
    resume: Resume | None = None
    continuation: dict[str, Any] | None = None
    continued_tokens: int = 0
    legs: list[LegUsage] = field(default_factory=list)
    _payloads: dict[tuple[str, bool], bytes] = field(default_factory=dict)

    @property
    def cost(self) -> int:
        """Tokens it holds at its endpoint while in flight (prompt + expected output), for utilisation."""
        est = self.decision.estimate
        return est.tokens if est is not None else 0

    def payload_for(self, pool: Pool, model: Model) -> bytes:
        """The body for ``pool`` serving ``model``: the name it serves the model under (the pool's model, or an
        adapter's name), and a ``priority`` only where it is honoured.

        (A ``priority`` given as a class name is always replaced or removed: engines want a number; the
        tokenizer endpoints never get one.) A resumed stream's tries send its :attr:`continuation` instead, with
        the usage chunk always asked for.
        """
        served = model.served_name or pool.served_model
        cls = self.decision.cls
        prioritised = pool.priority_scheduling and cls is not None and self.kind not in ("tokenize", "detokenize")
        if self.continuation is not None:
            body = dict(self.continuation, model=served)
            body.pop("priority", None)
            if prioritised and cls is not None:
                body["priority"] = cls.engine_priority
            return msgspec.json.encode(body)
        key = (served, prioritised)
        payload = self._payloads.get(key)
        if payload is None:
            body = self.body
            wanted = cls.engine_priority if prioritised and cls is not None else None
            if body["model"] == served and body.get("priority") == wanted and not self.force_usage:
                payload = self.raw
            else:
                body = dict(body, model=served)
                if wanted is None:
                    body.pop("priority", None)
                else:
                    body["priority"] = wanted
                if self.force_usage:
                    options = body.get("stream_options")
                    body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
                payload = msgspec.json.encode(body)
            self._payloads[key] = payload
        return payload
