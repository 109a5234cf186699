"""The ``tests`` section of the policy document: requests and what the decision path must make of them.

The tests run in :mod:`switchyard.decide.policy_tests`, on validate and before publish.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from switchyard.policy.base import ModelName, Name, Strict


class PolicyTestRequest(Strict):
    """The request a policy test sends through the decision path."""

    model: ModelName
    tier: Name
    kind: Literal["chat", "completion", "embedding", "responses", "tokenize", "detokenize"] = Field(
        default="chat", description="The API the request is sent to: chat (`/v1/chat/completions`), completion "
        "(`/v1/completions`), embedding (`/v1/embeddings`), responses (`/v1/responses`), tokenize or detokenize "
        "(`/tokenize`, `/detokenize`). `prompt` is its text (the input, for embeddings and responses).")
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
