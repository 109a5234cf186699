"""The routing sections of the policy document: classifiers and endpoint-picking profiles.

An *endpoint profile* is a list of plugins, as the Kubernetes inference gateway's endpoint picker
has them: filters narrow the candidate endpoints, weighted scorers give each survivor a score in
[0, 1], one picker chooses. Every plugin is a typed spec here (its ``type`` is the discriminator,
so an unknown type or a bad parameter is reported at its YAML location); the factories that turn
specs into functions are registered in :mod:`switchyard.decide.plugins`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, StringConstraints, model_validator

Name = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]{0,62}$")]
HeaderName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9-]{1,64}$")]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- filters ------------------------------------------------------------------------------------

class HealthyFilter(_Spec):
    """Leave out endpoints out of service (failed health probes, a refused connection, an open breaker).

    Picking always does this before any filter runs (``resilience`` in the policy says when an endpoint
    is out), so naming it changes nothing; it is kept so that documents naming it stay valid.
    """

    type: Literal["healthy"]


class ServesModelFilter(_Spec):
    """Leave out endpoints whose engine reports (in its ``/metrics``) serving another model than the pool declares."""

    type: Literal["serves-model"]


class UnderSaturationFilter(_Spec):
    """Leave out endpoints at or above a utilisation (default: the request's class's dispatch ceiling,
    1.0 for interactive classes)."""

    type: Literal["under-saturation"]
    max_utilisation: float | None = Field(default=None, gt=0, le=2)


FilterSpec = Annotated[HealthyFilter | ServesModelFilter | UnderSaturationFilter,
                       Field(discriminator="type")]


# --- scorers ------------------------------------------------------------------------------------

class _Scorer(_Spec):
    weight: float = Field(default=1.0, gt=0, le=100, description="How much the score counts.")


class LoadScorer(_Scorer):
    """``(least load + 1) / (load + 1)``: load is the requests at the engine (scraped running + waiting,
    plus what this gateway sent since the scrape)."""

    type: Literal["load"]


class QueueDepthScorer(_Scorer):
    """``1 / (1 + waiting)``: requests waiting inside the engine at the last scrape."""

    type: Literal["queue-depth"]


class KvCacheScorer(_Scorer):
    """``1 - utilisation`` (clipped to [0, 1]): the KV-cache and sequence room the engine has left."""

    type: Literal["kv-cache"]


class InflightTokensScorer(_Scorer):
    """``(least + 1) / (tokens + 1)`` over the tokens this gateway has in flight at each endpoint."""

    type: Literal["inflight-tokens"]


class PrefixAffinityScorer(_Scorer):
    """The fraction of the prompt's leading blocks the endpoint served recently.

    Yields (scores 0) at an endpoint that is busy, so one hot prefix does not pile a burst onto
    one replica: when its engine has requests waiting, its utilisation is at or above
    ``yield_above_utilisation``, or its load exceeds the least loaded candidate's by more than
    ``herd_margin`` requests.
    """

    type: Literal["prefix-affinity"]
    yield_above_utilisation: float = Field(default=1.0, gt=0, le=2)
    herd_margin: float = Field(default=4.0, ge=0)


class KvCachePreciseScorer(_Scorer):
    """The share of the prompt, in tokens, that the endpoint's prefix cache holds now, as its engine's
    KV-cache events report (the pool's ``kv_events``): the longest leading run of the prompt's token blocks
    it holds, over the prompt's tokens.

    An endpoint whose events are not known now (no ``kv_events``, a stream still syncing, stale or cut)
    is scored by the approximate index instead, as ``prefix-affinity`` scores; the decision trace says
    which one decided. Yields (scores 0) at an endpoint at or above ``yield_above_utilisation`` or more than
    ``herd_margin`` requests above the least loaded candidate; unlike ``prefix-affinity`` (a guess), not
    merely because requests wait in its engine.
    """

    type: Literal["kv-cache-precise"]
    yield_above_utilisation: float = Field(default=1.0, gt=0, le=2)
    herd_margin: float = Field(default=4.0, ge=0)


class SessionAffinityScorer(_Scorer):
    """1 for the endpoint that served the request's session before (session id from ``header``, else the
    body's ``user`` when ``use_user`` is set), while it is healthy and under ``yield_above_utilisation``."""

    type: Literal["session-affinity"]
    header: HeaderName = "x-session-id"
    use_user: bool = True
    yield_above_utilisation: float = Field(default=1.0, gt=0, le=2)


class LoraAffinityScorer(_Scorer):
    """For a model that is a LoRA adapter (``adapter_of``): 1 where the adapter is active (its engine reports it
    running or waiting in ``vllm:lora_requests_info``, or this gateway has it in flight there), 0.8 where this
    gateway sent it within the last minute (likely still loaded), 0.5 where the engine has an adapter slot free of
    active and lately used adapters (fewer of them than its ``max_loras``), 0.3 where a slot is free only of active
    ones (the adapter would push a lately used one out), 0 where it would have to wait for a slot. An endpoint that is
    busy (at ``yield_above_utilisation`` or more than ``herd_margin`` requests above the least loaded candidate)
    is scored as if the adapter were not there, so one hot adapter spreads over more replicas. Every endpoint
    scores 1 for a base model's request."""

    type: Literal["lora-affinity"]
    yield_above_utilisation: float = Field(default=1.0, gt=0, le=2)
    herd_margin: float = Field(default=8.0, ge=0)


ScorerSpec = Annotated[LoadScorer | QueueDepthScorer | KvCacheScorer | InflightTokensScorer
                       | PrefixAffinityScorer | KvCachePreciseScorer | SessionAffinityScorer | LoraAffinityScorer,
                       Field(discriminator="type")]


# --- pickers ------------------------------------------------------------------------------------

class MaxScorePicker(_Spec):
    """The highest score; ties are broken at random."""

    type: Literal["max-score"]


class PowerOfTwoPicker(_Spec):
    """Two candidates drawn at random; the one with the higher score."""

    type: Literal["power-of-two"]


class RoundRobinPicker(_Spec):
    """The next candidate in turn, scores ignored (a baseline for ``switchyard bench``)."""

    type: Literal["round-robin"]


PickerSpec = Annotated[MaxScorePicker | PowerOfTwoPicker | RoundRobinPicker, Field(discriminator="type")]


def _default_filters() -> list[FilterSpec]:
    return [HealthyFilter(type="healthy"), ServesModelFilter(type="serves-model"),
            UnderSaturationFilter(type="under-saturation")]


class EndpointProfile(_Spec):
    """How the endpoint of a request is picked among a model's replicas.

    The regions a tier may be served in (``tiers[].regions``, data residency) are not a filter a
    profile could leave out: pools elsewhere are removed from the request's plan before any profile
    runs (:func:`switchyard.decide.pick.fallback_plan`), and from flow control's view of the model.
    """

    filters: list[FilterSpec] = Field(default_factory=_default_filters)
    scorers: list[ScorerSpec] = Field(default_factory=list)
    picker: PickerSpec = Field(default_factory=lambda: MaxScorePicker(type="max-score"))
    home_region: bool = Field(
        default=True, description="Prefer the request's home region (header, key, tenant, or the gateway's "
        "region) and spill over to the region with the most capacity left only when the home endpoints are "
        "saturated or unhealthy.")

    @model_validator(mode="after")
    def _sane(self) -> EndpointProfile:
        filters = [f.type for f in self.filters]
        if len(set(filters)) != len(filters):
            raise ValueError("a filter is listed twice")
        scorers = [s.type for s in self.scorers]
        if len(set(scorers)) != len(scorers):
            raise ValueError("a scorer is listed twice")
        if not self.scorers and self.picker.type != "round-robin":
            raise ValueError(f"the {self.picker.type} picker needs at least one scorer")
        return self


#: The profile of models that name none: Switchyard's own picking.
DEFAULT_PROFILE = EndpointProfile(scorers=[
    PrefixAffinityScorer(type="prefix-affinity", weight=0.6),
    LoadScorer(type="load", weight=0.4),
    SessionAffinityScorer(type="session-affinity", weight=0.5),
    LoraAffinityScorer(type="lora-affinity", weight=1.0),
])
#: Baselines that ``switchyard bench`` measures the profile against (``SWITCHYARD_PICKER``).
BASELINE_PROFILES: dict[str, EndpointProfile] = {
    "least-loaded": EndpointProfile(scorers=[LoadScorer(type="load")], home_region=False),
    "round-robin": EndpointProfile(picker=RoundRobinPicker(type="round-robin"), home_region=False),
}


# --- classifiers ----------------------------------------------------------------------------------

class FeaturesClassifier(_Spec):
    """Switchyard's built-in difficulty model: a logistic score over cheap text features of the request
    (no network, no GPU; see :mod:`switchyard.decide.difficulty`)."""

    type: Literal["features"]
    threshold: float = Field(default=0.5, gt=0, lt=1, description="The rule matches when the score is at least this.")


class EmbeddingExamples(_Spec):
    positive: list[Annotated[str, StringConstraints(min_length=1)]] = Field(min_length=1)
    negative: list[Annotated[str, StringConstraints(min_length=1)]] = Field(min_length=1)


class EmbeddingClassifier(_Spec):
    """Nearest centroid over embeddings from an embeddings pool: the score is
    ``(1 + cos(q, positive centroid) - cos(q, negative centroid)) / 2`` for the request's last user message."""

    type: Literal["embedding"]
    pool: Name = Field(description="A pool with `task: embed` serving the embedding model.")
    examples: EmbeddingExamples
    threshold: float = Field(default=0.5, gt=0, lt=1)
    timeout_ms: PositiveInt = Field(default=500, le=10_000, description="How long the gateway waits for the "
                                    "embedding; past it (or on an error) the rule does not match.")


ClassifierSpec = Annotated[FeaturesClassifier | EmbeddingClassifier, Field(discriminator="type")]
