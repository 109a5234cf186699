"""What one request's decision is made of: who asks and what, the effects the procedure asks its executor for
(and their answers), and the record of everything decided, filled in as the procedure goes.

The procedure itself is :mod:`switchyard.decide.procedure`; an executor creates a :class:`Decision` for a
request and drives the procedure over it.

The decisions' value types here and in the other decision modules are plain (not frozen) slotted
dataclasses that nothing changes after making them: they are made for every request, and a frozen
dataclass costs about four times as much to make.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from switchyard.decide.admit import Estimate, LimitCharge, Reserve
from switchyard.decide.cache import CachePlan, CanonicalRequest, RequestKind
from switchyard.decide.classes import ClassDecision
from switchyard.decide.features import RequestFeatures
from switchyard.decide.flow import Queue, Scheduled
from switchyard.decide.pick import EndpointChoice, Stage, Strategy
from switchyard.decide.picking import PromptRenderer, Subject
from switchyard.decide.refusals import Refusal
from switchyard.decide.regions import Placement
from switchyard.decide.resolve import ModelDecision
from switchyard.decide.tokens import TokenCounter
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.policy.tiers import Limits

#: A batch-lane request preempted this many times runs to its end: every request makes progress.
MAX_PREEMPTIONS = 8


@dataclass(slots=True)
class Caller:
    """Who sends the request, as authentication found it.

    Attributes:
        tier: The tenant's tier.
        tenant: A stable id of the tenant (limit buckets and queue fairness are keyed by it).
        key: A stable id of the API key.
        tenant_limits: The tenant's limit override (each limit it sets replaces the tier's).
        key_limits: The key's own limits (charged in addition).
        region: The key's or tenant's home region.
    """

    tier: str
    tenant: str
    key: str
    tenant_limits: Limits | None = None
    key_limits: Limits | None = None
    region: str | None = None


@dataclass(slots=True)
class Ask:
    """A request to decide.

    Attributes:
        kind: ``chat`` or ``completion``.
        body: The parsed, validated OpenAI request body.
        features: What the policy looks at in it (its headers included).
        caller: Who sends it.
        gateway_region: The executing gateway's region (a home region when the caller has none).
        strategy: The picking strategy (the policy's profiles, or a baseline the bench measures against).
        flow_control: Whether flow control runs (off: every admitted request goes at once).
        counters: Prompt counters by model (a model's own tokenizer counts exactly; others estimate).
        renderers: Prompt renderers by model: the token ids its engine will cache (for the precise
            KV-cache scorer; a model without one is scored by the approximate index).
        canonical: See the attribute.
    """

    kind: RequestKind
    body: Mapping[str, Any]
    features: RequestFeatures
    caller: Caller
    gateway_region: str | None = None
    strategy: Strategy = "prefix-aware"
    flow_control: bool = True
    counters: Mapping[str, TokenCounter] = field(default_factory=dict)
    renderers: Mapping[str, PromptRenderer] = field(default_factory=dict)
    #: The body's canonical form for cache keys, when the executor already made it (the gateway does, for the
    #: request log's digest); None: made where needed.
    canonical: CanonicalRequest | None = None


# --- effects: what the procedure asks its executor -------------------------------------------------

class Later:
    """A trace line put into words only when it is read (most requests' traces never are): ``say(*args)``."""

    __slots__ = ("_args", "_say", "_text")

    def __init__(self, say: Callable[..., str], *args: Any) -> None:
        self._say = say
        self._args = args
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._say(*self._args)
        return self._text


#: A line of a decision's trace.
Line = str | Later


@dataclass(slots=True)
class Score:
    """The score of classifier ``name`` for the request (an embedding); answered with a float, or None when
    it cannot be had (its rules then do not match)."""

    name: str
    features: RequestFeatures


@dataclass(slots=True)
class CacheHit:
    """A response-cache entry for the request: the answer's usage."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class LookupCache:
    """Look the request up in the response cache under ``plan``; answered with a :class:`CacheHit` or None."""

    plan: CachePlan


@dataclass(slots=True)
class Retry:
    """Whether the retry budget lets a retry go: the ``number``-th try of a dispatch, 2 or more (the first always
    goes: the executor counts it for its budget when it makes it)."""

    number: int


@dataclass(slots=True)
class Attempt:
    """Send the request to ``choice`` (of ``stage`` of the plan), picked from ``picked`` on the fleet's clock (the
    pick's stage, for executors that time stages); answered with :class:`Tried`.

    Attributes:
        deadline_s: How long the try may go without producing (its class's first-token deadline): then it
            moves on (``first_token_timeout``).
        hedge_after: Answer ``slow`` (the try going on) when no first token has come this many seconds after the
            send, so that the procedure may hedge it (:class:`Hedge`); None: never.
        resuming: The try continues a stream another engine broke off (the executor sends the continuation
            and splices its answer into the client's stream).
    """

    decision: Decision
    stage: Stage
    choice: EndpointChoice
    picked: float = 0.0
    deadline_s: float = 15.0
    hedge_after: float | None = None
    resuming: bool = False


@dataclass(slots=True)
class Hedge:
    """A try answered ``slow`` (``pending``, at ``pending_url``): also send the request to ``choice`` (None: do not
    hedge, keep waiting for the pending try), take whichever answers first and abort the other; answered with
    :class:`Raced`."""

    decision: Decision
    stage: Stage
    choice: EndpointChoice | None
    pending: Tried
    pending_url: str
    picked: float = 0.0


@dataclass(slots=True)
class Raced:
    """What a :class:`Hedge` came to: the try that answers the request (``tried``, at ``url``) and the other one,
    if there was one (``other``, at ``other_url``: aborted as ``cancelled``, or ``failed``)."""

    tried: Tried
    url: str
    other: Tried | None = None
    other_url: str | None = None


@dataclass(slots=True)
class Mark:
    """A stage ended (``queue``: flow control; ``pick``: an endpoint choice that is not then tried: none could
    take the request, or the retry budget was spent), for executors that time or trace stages; answered with
    None.

    Attributes:
        stage: Its name.
        started: The fleet's clock when it began.
        label: The plan's stage a pick was for.
        choice: What a pick chose (None: no endpoint could take the request).
        refusal: Why flow control refused the request, if it did.
    """

    stage: Literal["queue", "pick"]
    started: float
    label: str = ""
    choice: EndpointChoice | None = None
    refusal: Refusal | None = None


@dataclass(slots=True)
class Tried:
    """What one try at an endpoint came to.

    Attributes:
        outcome: ``ok`` (it answered), ``refused`` (it answered with the client's error, which is final),
            ``failed`` (worth trying elsewhere), ``preempted`` (flow control took it back for an
            interactive request: it queues again), ``slow`` (no first token by the attempt's ``hedge_after``:
            the try goes on, and ``answer`` is the executor's handle of it), or ``cancelled`` (a hedge's
            loser, aborted).
        kind: Why it failed, short (``connect_error``, ``timeout``, ``first_token_timeout``, a status...).
        reason: Why it failed, for the trace.
        answer: The executor's own answer (its response, or its error for the client).
    """

    outcome: Literal["ok", "refused", "failed", "preempted", "slow", "cancelled"]
    kind: str = ""
    reason: str = ""
    answer: Any = None


Effect = Score | LookupCache | Reserve | Queue | Retry | Attempt | Hedge | Mark


# --- what was decided ------------------------------------------------------------------------------

@dataclass(slots=True)
class Attempts:
    """One dispatch's way through its fallback plan: what was tried, what was passed over, and why.

    Attributes:
        limit: The most tries (the policy's ``resilience.retries.max_attempts``).
        tried: The endpoints tried.
        failures: Every step that moved the request on, in order: ``"<url or stage>: <reason>"``.
        moved_on: The same, short (``"<url or stage> <kind>"``), for the route header.
        last: The last failed try.
        budget_spent: A retry was not sent because the retry budget was spent.
        retry_in: Seconds until an endpoint that is out may take requests again, when known.
    """

    limit: int
    tried: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    moved_on: list[str] = field(default_factory=list)
    last: Tried | None = None
    budget_spent: bool = False
    retry_in: float | None = None

    @property
    def count(self) -> int:
        """Tries made."""
        return len(self.tried)

    def failed(self, url: str, tried: Tried) -> None:
        """The try at ``url`` failed."""
        self.failures.append(f"{url}: {tried.reason}")
        self.moved_on.append(f"{url} {tried.kind}")
        self.last = tried

    def passed_over(self, stage: str, reason: str) -> None:
        """A stage of the plan had no endpoint that could take the request."""
        self.failures.append(f"{stage}: {reason}")
        self.moved_on.append(f"{stage} unavailable")


Outcome = Literal["deciding", "refused", "cache_hit", "served", "failed"]


@dataclass(slots=True, eq=False)
class Decision:
    """Everything decided for one request, filled in as the procedure goes (an executor may read it at any
    point, for instance to record how far a request came before its client left).

    ``outcome``: ``refused`` (``refusal`` says why), ``cache_hit`` (``hit``), ``served`` (``tried`` is the
    try that answered: ``ok``, or the engine's own refusal of the client's request), ``failed`` (every
    try failed: ``attempts.last``).
    """

    snapshot: PolicySnapshot
    ask: Ask
    outcome: Outcome = "deciding"
    model: ModelDecision | None = None
    placement: Placement | None = None
    cls: ClassDecision | None = None
    cache: CachePlan | None = None
    hit: CacheHit | None = None
    prompt_tokens: int = 0
    estimate: Estimate | None = None
    charges: tuple[LimitCharge, ...] = ()
    scheduled: Scheduled | None = None
    stages: list[Stage] = field(default_factory=list)
    attempts: Attempts | None = None
    stage: Stage | None = None
    choice: EndpointChoice | None = None
    tried: Tried | None = None
    preemptions: int = 0
    #: Times its stream was resumed on another endpoint after its engine broke it off.
    resumes: int = 0
    #: Hedges sent for it (a second endpoint asked while the first try's first token was late).
    hedges: int = 0
    refusal: Refusal | None = None
    trace: list[Line] = field(default_factory=list)
    #: The request as the picks see it (:class:`~switchyard.decide.picking.Subject`): made once, so that a prompt
    #: rendered to count it is not rendered again to pick its endpoint.
    subject: Subject | None = None

    @property
    def gives_way(self) -> bool:
        """Whether the request gives way to interactive requests while in flight: a batch-lane request
        answered as one JSON object (nothing has reached its client until it ends), preempted fewer than
        :data:`MAX_PREEMPTIONS` times."""
        cls = self.cls
        return (cls is not None and cls.cls.lane == "batch" and not self.ask.body.get("stream")
                and self.preemptions < MAX_PREEMPTIONS)

    def refuse(self, refusal: Refusal) -> Decision:
        """End the procedure with ``refusal``."""
        self.outcome, self.refusal = "refused", refusal
        self.trace.append(f"refused {refusal.status} ({refusal.code}): {refusal.message}")
        return self
