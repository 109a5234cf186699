"""The fleet sections of the policy document: pools of replicas, and the models they serve.

A model carries its price, its fallback chain and what to do when its pools are saturated.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    StringConstraints,
    model_validator,
)

from switchyard.policy.base import ModelName, Name, Strict
from switchyard.policy.units import Duration


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
