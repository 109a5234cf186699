"""The policy document's schema (``schema: 1``), as frozen pydantic models.

Field-level rules live here (types, ranges, formats, one-section invariants). Rules that span
sections (a model naming an unknown pool, a fallback cycle, ...) live in
:mod:`switchyard.policy.references`, so that every error can still name its own YAML location.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    StringConstraints,
    model_validator,
)

from switchyard.policy.resilience import Resilience
from switchyard.policy.routing import ClassifierSpec, EndpointProfile
from switchyard.policy.units import Duration

SCHEMA_VERSION = 1

# Identifiers of regions, pools, tiers and priority classes: short, lower-case, URL- and
# label-safe (they end up in metric labels and response headers).
Name = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]{0,62}$")]

# What clients put in "model". '@' is reserved for "model@region" in fallback chains.
ModelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")]

def _check_regex(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None
    return pattern


Regex = Annotated[str, StringConstraints(min_length=1), AfterValidator(_check_regex)]


def _check_endpoint(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"endpoint {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"endpoint {url!r} has no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"endpoint {url!r} must not carry a query, fragment or credentials")
    try:
        parts.port  # noqa: B018 - raises on an out-of-range or malformed port
    except ValueError as exc:
        raise ValueError(f"endpoint {url!r}: {exc}") from None
    if parts.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"endpoint {url!r}: give the server's base URL, without /v1")
    return url.rstrip("/")


EndpointUrl = Annotated[str, AfterValidator(_check_endpoint)]


class Strict(BaseModel):
    """Base of every section: unknown keys are errors, parsed documents are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Pool(Strict):
    """A set of vLLM replicas serving one model in one region."""

    name: Name
    region: Name
    served_model: str = Field(min_length=1, description="The name the vLLM servers serve (--served-model-name).")
    endpoints: list[EndpointUrl] = Field(min_length=1, description="Base URLs of the replicas.")
    kv_cache_tokens: PositiveInt = Field(description="KV-cache capacity of each replica, in tokens.")
    sim_profile: str = Field(
        default="h100-8b",
        min_length=1,
        description="Hardware profile `switchyard sim` uses when it simulates this pool.",
    )
    priority_scheduling: bool = Field(
        default=False,
        description="The replicas run vLLM with `--scheduling-policy priority`: requests carry a `priority` "
        "from their class. Other pools get no `priority` field (vLLM rejects it there).",
    )
    max_num_seqs: PositiveInt | None = Field(
        default=None,
        description="vLLM's --max-num-seqs of the replicas, when known: a replica running this many requests "
        "counts as saturated (see the utilisation formula in the README).",
    )
    batch_reserve_slots: NonNegativeInt = Field(
        default=1,
        description="With max_num_seqs: sequence slots of the pool (all its replicas together) that batch-lane "
        "work leaves free, so that an interactive request arriving finds one without preempting batch work.",
    )
    task: Literal["generate", "embed"] = Field(
        default="generate", description="`embed`: the replicas serve an embedding model (`/v1/embeddings`), "
        "for embedding classifiers; models cannot use such a pool.")

    @model_validator(mode="after")
    def _unique_endpoints(self) -> Pool:
        seen: set[str] = set()
        for url in self.endpoints:
            if url in seen:
                raise ValueError(f"endpoint {url} is listed twice")
            seen.add(url)
        return self


class Price(Strict):
    """Prices per million tokens, in the operator's currency (USD in the demo)."""

    input_per_mtok: NonNegativeFloat
    output_per_mtok: NonNegativeFloat
    cached_input_per_mtok: NonNegativeFloat | None = None
    batch_input_per_mtok: NonNegativeFloat | None = Field(
        default=None, description="A batch job's input rate (default: half of input_per_mtok, as OpenAI's Batch API).")
    batch_output_per_mtok: NonNegativeFloat | None = Field(
        default=None, description="A batch job's output rate (default: half of output_per_mtok).")

    def batch_rates(self) -> tuple[float, float]:
        """(input, output) per million tokens for batch jobs."""
        return (self.batch_input_per_mtok if self.batch_input_per_mtok is not None else self.input_per_mtok / 2,
                self.batch_output_per_mtok if self.batch_output_per_mtok is not None else self.output_per_mtok / 2)


_FALLBACK = re.compile(r"^(?P<model>[A-Za-z0-9][A-Za-z0-9._:/-]{0,127})(?:@(?P<region>[a-z][a-z0-9_-]{0,62}))?$")


def _check_fallback(target: str) -> str:
    if not _FALLBACK.match(target):
        raise ValueError(f"fallback {target!r} must be 'model' or 'model@region'")
    return target


FallbackTarget = Annotated[str, AfterValidator(_check_fallback)]


def split_fallback(target: str) -> tuple[str, str | None]:
    """Split ``"large@eu-west"`` into ``("large", "eu-west")`` and ``"medium"`` into ``("medium", None)``."""
    model, _, region = target.partition("@")
    return model, region or None


def _check_tokenizer_path(path: str) -> str:
    if "://" in path:
        raise ValueError(f"tokenizer {path!r} must be a local file path (tokenizers are never downloaded)")
    return path


TokenizerPath = Annotated[str, StringConstraints(min_length=1), AfterValidator(_check_tokenizer_path)]


class OnSaturation(Strict):
    """What to do when every pool of a model is saturated: serve chosen classes with a cheaper model."""

    downgrade_to: ModelName = Field(description="The model that serves the request instead.")
    classes: list[Name] | None = Field(
        default=None, min_length=1, description="Priority classes that may be downgraded (default: all).")


class Model(Strict):
    """What clients put in ``model``: a concrete model served by one or more pools."""

    name: ModelName
    pools: list[Name] = Field(min_length=1)
    context_window: PositiveInt
    max_output_tokens: PositiveInt | None = Field(
        default=None, description="Largest max_tokens a request may ask for (default: the context window)."
    )
    default_max_tokens: PositiveInt = Field(
        default=512, description="Expected output of a request that does not set max_tokens."
    )
    price: Price
    fallback: list[FallbackTarget] = Field(default_factory=list)
    tokenizer: TokenizerPath | None = Field(
        default=None,
        description="Path of the served model's tokenizer.json, relative to the policy file's folder; prompts "
        "are then counted with it instead of estimated. A local file: it is never downloaded.",
    )
    on_saturation: OnSaturation | None = Field(
        default=None, description="Degrade before refusing: when the model's pools are saturated, requests "
        "of the chosen classes are served by `downgrade_to` instead of queueing or being shed.")
    endpoint_profile: Name | None = Field(
        default=None, description="The `endpoint_profiles` entry that picks this model's endpoints (default: "
        "Switchyard's built-in profile).")
    first_token_timeout: Duration | None = Field(
        default=None, description="This model's first-token timeout for streamed answers (default: "
        "`resilience.first_token_timeout`).")

    @model_validator(mode="after")
    def _consistent(self) -> Model:
        if len(set(self.pools)) != len(self.pools):
            raise ValueError("a pool is listed twice")
        if self.max_output_tokens is not None and self.max_output_tokens > self.context_window:
            raise ValueError(
                f"max_output_tokens ({self.max_output_tokens}) exceeds context_window ({self.context_window})"
            )
        cap = self.max_output_tokens or self.context_window
        if self.default_max_tokens > cap:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) exceeds the output cap ({cap})")
        if len(set(self.fallback)) != len(self.fallback):
            raise ValueError("a fallback target is listed twice")
        return self


class RuleConditions(Strict):
    """Conditions of a routing rule; all given conditions must hold (logical AND)."""

    prompt_tokens_lt: PositiveInt | None = None
    prompt_tokens_gte: PositiveInt | None = None
    messages_lt: PositiveInt | None = None
    messages_gte: PositiveInt | None = None
    max_tokens_lt: PositiveInt | None = None
    max_tokens_gte: PositiveInt | None = None
    has_tools: bool | None = None
    json_mode: bool | None = None
    has_images: bool | None = None
    match: Regex | None = Field(default=None, description="Regex searched in the last user message.")
    no_match: Regex | None = Field(default=None, description="Regex that must not occur in the last user message.")
    system_match: Regex | None = Field(default=None, description="Regex searched in the system prompt.")
    tier: list[Name] | None = Field(default=None, min_length=1)
    header: dict[str, str] | None = Field(
        default=None, min_length=1, description="Request headers that must carry exactly these values."
    )
    classifier: Name | None = Field(
        default=None, description="A classifier of the `classifiers` section that must say yes (its score is at "
        "least its threshold).")

    @model_validator(mode="after")
    def _not_empty_or_contradictory(self) -> RuleConditions:
        if not self.model_fields_set:
            raise ValueError("a rule needs at least one condition (use the route's default instead)")
        for low, high in (("prompt_tokens_gte", "prompt_tokens_lt"), ("messages_gte", "messages_lt"),
                          ("max_tokens_gte", "max_tokens_lt")):
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo >= hi:
                raise ValueError(f"{low} ({lo}) >= {high} ({hi}): the rule can never match")
        return self


class Rule(Strict):
    """A routing rule: when the conditions hold, the route resolves to ``model``."""

    name: str | None = None
    when: RuleConditions
    model: ModelName


class Route(Strict):
    """A virtual model (such as ``auto``): rules in order, first match wins, else ``default``."""

    name: ModelName
    rules: list[Rule] = Field(default_factory=list)
    default: ModelName
    compare_to: ModelName | None = Field(
        default=None, description="The model whose estimated cost the decision trace compares the chosen one "
        "with (default: the most expensive model the route can choose).")


#: How long a batch-lane request may wait when its class sets no max_queue_ms.
BATCH_MAX_QUEUE_MS = 600_000
#: The utilisation under which batch-lane work is dispatched when its class sets no max_utilisation.
BATCH_MAX_UTILISATION = 0.95
#: Interactive requests (someone waits) and batch work (nobody waits) share engines, never a queue.
Lane = Literal["interactive", "batch"]


class PriorityClass(Strict):
    """A priority class: how long its requests may queue and when they are shed.

    Interactive classes are served best first; within a class tenants share by start-time fair
    queuing in tokens. Batch-lane classes wait in a queue of their own that is served only while
    the pool's interactive queue is empty and its utilisation is under ``max_utilisation``.
    """

    lane: Lane = "interactive"
    max_queue_ms: PositiveInt | None = Field(
        default=None, description="How long a request may wait in the gateway's queue (required for the "
        f"interactive lane; batch lane default {BATCH_MAX_QUEUE_MS}).")
    shed_above_utilisation: float | None = Field(
        default=None, gt=0, le=1,
        description="Refuse (503) requests of this class at once while their pools' utilisation is above this.")
    max_utilisation: float | None = Field(
        default=None, gt=0, le=1,
        description=f"Batch lane only: dispatch while the pool's utilisation is below this "
        f"(default {BATCH_MAX_UTILISATION}).")
    engine_priority: int | None = Field(
        default=None, ge=-1_000_000, le=1_000_000,
        description="vLLM request `priority` for this class (lower is served first). Default: the class's "
        "position in `priorities` times 10 (0 for the first class, 10 for the second, ...), plus 1000 for a "
        "batch-lane class, so that the engine preempts batch work first.",
    )

    @model_validator(mode="after")
    def _deadline(self) -> PriorityClass:
        if self.lane == "interactive" and self.max_queue_ms is None:
            raise ValueError("an interactive class needs max_queue_ms (its queue deadline)")
        if self.lane == "interactive" and self.max_utilisation is not None:
            raise ValueError("max_utilisation applies to the batch lane only (an interactive class uses "
                             "shed_above_utilisation)")
        return self

    @property
    def queue_deadline_s(self) -> float:
        """How long a request of the class may wait in the gateway's queue, in seconds."""
        ms = self.max_queue_ms if self.max_queue_ms is not None else BATCH_MAX_QUEUE_MS
        return ms / 1000.0

    @property
    def dispatch_ceiling(self) -> float:
        """The utilisation under which the class's requests are dispatched."""
        if self.lane == "batch":
            return self.max_utilisation if self.max_utilisation is not None else BATCH_MAX_UTILISATION
        return 1.0


class Limits(Strict):
    """Token-denominated limits; absent means unlimited."""

    tokens_per_minute: PositiveInt | None = None
    requests_per_minute: PositiveInt | None = None
    tokens_per_day: PositiveInt | None = None
    spend_per_month: PositiveFloat | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Limits:
        tpm, tpd = self.tokens_per_minute, self.tokens_per_day
        if tpm is not None and tpd is not None and tpm > tpd:
            raise ValueError(f"tokens_per_minute ({tpm}) exceeds tokens_per_day ({tpd})")
        return self


class Tier(Strict):
    """A class of tenants: its priority, the models it may use, and its limits."""

    name: Name
    priority: Name
    models: list[Annotated[str, StringConstraints(min_length=1)]] = Field(
        min_length=1, description="Models and routes this tier may call; '*' for all."
    )
    limits: Limits = Field(default_factory=Limits)
    model_limits: dict[ModelName, Limits] = Field(default_factory=dict)
    regions: list[Name] | None = Field(
        default=None, min_length=1, description="Regions this tier's requests may be served in (data residency; "
        "default: all). Endpoints elsewhere are filtered out, fallbacks included.")


class CacheMatch(Strict):
    """Which requests a cache rule applies to; an absent list matches everything."""

    models: list[ModelName] | None = Field(default=None, min_length=1)
    routes: list[ModelName] | None = Field(default=None, min_length=1)
    tiers: list[Name] | None = Field(default=None, min_length=1)
    nondeterministic: bool = Field(
        default=False, description="Also cache requests with temperature > 0 and no seed."
    )


class CacheRule(Strict):
    """A response-cache rule: which requests, exact or semantic, for how long, shared how widely."""

    name: str | None = None
    match: CacheMatch = Field(default_factory=CacheMatch)
    mode: Literal["exact", "semantic"] = "exact"
    min_similarity: float | None = Field(
        default=None, gt=0, le=1, description="Semantic rules: the least cosine similarity of the last user turn "
        "to a cached one (in the same conversation context) that counts as a hit.")
    embedding_pool: Name | None = Field(
        default=None, description="Semantic rules: the pool (`task: embed`) that embeds the last user turn.")
    ttl: Duration
    scope: Literal["tenant", "global"] = Field(
        default="tenant", description="`tenant`: entries are served only to the tenant that stored them; `global`: "
        "to every tenant (explicit opt-in, for shared public content).")
    max_entry_bytes: PositiveInt = Field(default=262_144, description="Larger answers are not stored.")
    max_entries: PositiveInt = Field(
        default=10_000, description="Most entries the rule keeps (per gateway process in memory; in Redis, per "
        "deployment); the least recently used go first.")
    hit_charge: float = Field(
        default=0.0, ge=0.0, le=1.0, description="Share of a hit's tokens and price charged to the tenant's limits "
        "and spend (0: a hit is free; its usage is recorded as cached).")

    @model_validator(mode="after")
    def _mode_fields(self) -> CacheRule:
        if self.mode == "semantic":
            if self.min_similarity is None:
                raise ValueError("a semantic rule needs min_similarity")
            if self.embedding_pool is None:
                raise ValueError("a semantic rule needs embedding_pool")
        elif self.min_similarity is not None or self.embedding_pool is not None:
            raise ValueError("min_similarity and embedding_pool apply to mode: semantic only")
        return self


class PolicyTestRequest(Strict):
    """The request a policy test sends through the decision path."""

    model: ModelName
    tier: Name
    prompt: str = ""
    prompt_tokens: PositiveInt | None = Field(
        default=None, description="The prompt's length in tokens, when the text does not matter (overrides "
        "the estimate from `prompt`).")
    system: str | None = None
    messages: PositiveInt = 1
    max_tokens: PositiveInt | None = None
    tools: bool = False
    json_mode: bool = False
    images: bool = False
    headers: dict[str, str] = Field(default_factory=dict)
    temperature: float | None = Field(
        default=None, ge=0, le=2, description="The request's temperature (0 makes it deterministic, so a cache "
        "rule may apply: the trace says which).")
    priority: Name | None = Field(default=None, description="A priority class the request asks for (it may "
                                  "only lower its tier's class).")


class PolicyTestExpect(Strict):
    """What a policy test expects; every field given must hold.

    ``status``: 200 (admitted) or the refusal's HTTP status (429 with ``limit``: the request alone
    is larger than that limit of its tier, as fresh buckets see it). ``model``: the resolved model.
    ``pool`` / ``region``: where the gateway's picker sends the request when every endpoint is
    idle and healthy (the first stage of the fallback plan).
    """

    status: Literal[200, 400, 403, 404, 429] | None = None
    limit: Literal["tokens_per_minute", "requests_per_minute", "tokens_per_day", "spend_per_month"] | None = Field(
        default=None, description="With status 429: the limit that refuses it (a request larger than the limit).")
    model: ModelName | None = None
    pool: Name | None = None
    region: Name | None = None
    priority: Name | None = Field(default=None, description="The priority class the request is served in.")

    @model_validator(mode="after")
    def _some(self) -> PolicyTestExpect:
        if (self.status is None and self.model is None and self.pool is None and self.region is None
                and self.priority is None):
            raise ValueError("expect at least one of status, model, pool, region, priority")
        if self.status not in (None, 200) and (self.model or self.pool or self.region or self.priority):
            raise ValueError("a refused request has no model, pool, region or priority to expect")
        if self.limit is not None and self.status != 429:
            raise ValueError("expect a limit only with status 429")
        return self


class PolicyTest(Strict):
    """A policy unit test, run on validate and before publish."""

    name: str | None = None
    request: PolicyTestRequest
    expect: PolicyTestExpect


class PolicyDocument(Strict):
    """The whole policy document."""

    schema_: Literal[1] = Field(alias="schema", description="Version of this document's schema.")
    regions: list[Name] = Field(min_length=1)
    pools: list[Pool] = Field(min_length=1)
    models: list[Model] = Field(min_length=1)
    routes: list[Route] = Field(default_factory=list)
    priorities: dict[Name, PriorityClass] = Field(min_length=1, description="Classes, best first.")
    tiers: list[Tier] = Field(min_length=1)
    cache: list[CacheRule] = Field(default_factory=list)
    classifiers: dict[Name, ClassifierSpec] = Field(
        default_factory=dict, description="Named classifiers that routing rules use (`when: {classifier: NAME}`).")
    endpoint_profiles: dict[Name, EndpointProfile] = Field(
        default_factory=dict, description="Endpoint-picking profiles (filters, weighted scorers, a picker) that "
        "models name in `endpoint_profile`.")
    resilience: Resilience = Field(
        default_factory=Resilience, description="Health probes, circuit breakers, retries, the first-token timeout "
        "and what happens when Redis or the database cannot be reached.")
    tests: list[PolicyTest] = Field(default_factory=list)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
