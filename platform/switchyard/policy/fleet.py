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


def _check_socket(address: str) -> str:
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return address
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.hostname == "*":
        raise ValueError(f"{address!r} must be tcp://HOST:PORT (the host to connect to) or ipc://PATH")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{address!r}: {exc}") from None
    if port is None:
        raise ValueError(f"{address!r} has no port")
    return address


EventSocket = Annotated[str, AfterValidator(_check_socket)]


class EventSockets(Strict):
    """One engine's event sockets, given whole."""

    events: EventSocket = Field(description="Its events (ZeroMQ PUB) socket: tcp://HOST:PORT or ipc://PATH.")
    replay: EventSocket | None = Field(default=None, description="Its replay (ZeroMQ ROUTER) socket.")


class KvEvents(Strict):
    """Where a pool's engines publish their KV-cache events (vLLM's ``--kv-events-config``).

    The ports are the same on every endpoint's host (``port``, ``replay_port``: one engine per host, as in
    Kubernetes), or relative to each endpoint's HTTP port (``port_offset``, ``replay_port_offset``: several
    engines on one host), or given whole per endpoint (``sockets``: an ipc:// path, another host); ``sockets``
    wins for the endpoints it names. Every gateway process subscribes to every endpoint's events.
    """

    port: int | None = Field(default=None, ge=1, le=65535,
                             description="The events (ZeroMQ PUB) port on each endpoint's host.")
    replay_port: int | None = Field(default=None, ge=1, le=65535,
                                    description="The replay (ZeroMQ ROUTER) port on each endpoint's host.")
    port_offset: int | None = Field(default=None, description="Events port = the endpoint's HTTP port + this.")
    replay_port_offset: int | None = Field(
        default=None, description="Replay port = the endpoint's HTTP port + this.")
    sockets: dict[EndpointUrl, EventSockets] = Field(
        default_factory=dict, description="Each named endpoint's sockets, given whole (by its base URL).")
    topic: str = Field(default="", description="The engines' `topic` (the first frame of every message).")
    stale_after: Duration = Field(
        default=30.0, gt=0, description="A stream counts as stale (the approximate index routes instead) when "
        "requests that must have stored blocks at its engine went this long without an event.")

    @model_validator(mode="after")
    def _one_way(self) -> KvEvents:
        if self.port is not None and self.port_offset is not None:
            raise ValueError("give `port` or `port_offset`, not both")
        if self.port is None and self.port_offset is None and not self.sockets:
            raise ValueError("give `port`, `port_offset` or `sockets`")
        if self.replay_port is not None and self.replay_port_offset is not None:
            raise ValueError("give `replay_port` or `replay_port_offset`, not both")
        if self.port is not None and self.replay_port_offset is not None:
            raise ValueError("`port` goes with `replay_port`; `port_offset` with `replay_port_offset`")
        return self

    def addresses(self, endpoint: str) -> tuple[str, str | None]:
        """The events and replay sockets of the engine at ``endpoint`` (``tcp://host:port`` or ``ipc://path``).

        Raises:
            KeyError: ``sockets`` does not name ``endpoint`` and no port or offset is given.
        """
        given = self.sockets.get(endpoint.rstrip("/"))
        if given is not None:
            return given.events, given.replay
        if self.port is None and self.port_offset is None:
            raise KeyError(endpoint)
        parts = urlsplit(endpoint)
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        http_port = parts.port or (443 if parts.scheme == "https" else 80)
        events = self.port if self.port is not None else http_port + (self.port_offset or 0)
        replay = (self.replay_port if self.replay_port is not None
                  else http_port + self.replay_port_offset if self.replay_port_offset is not None else None)
        return f"tcp://{host}:{events}", (f"tcp://{host}:{replay}" if replay is not None else None)


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
        default="generate", description="`embed`: the replicas serve an embedding model (`/v1/embeddings`): "
        "for embedding classifiers, semantic caches and the models of `kind: embedding` that clients call.")
    max_loras: PositiveInt | None = Field(
        default=None, description="vLLM's --max-loras of the replicas: the most LoRA adapters one replica runs "
        "at once (default: vLLM's, 1). The picker keeps an adapter's requests on replicas that have it loaded "
        "and counts a replica whose slots are all taken by other adapters as a poor choice for a new one.")
    runtime_lora_loading: bool = Field(
        default=False, description="The replicas run with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: before an "
        "adapter model's first request to a replica, the gateway loads the adapter there "
        "(`POST /v1/load_lora_adapter` with the model's `adapter_path`). Otherwise the replicas serve the adapters "
        "given at start-up (`--lora-modules`).")
    kv_events: KvEvents | None = Field(
        default=None, description="Where the replicas publish their KV-cache events (`--kv-events-config`): "
        "the `kv-cache-precise` scorer routes on what they report.")

    @model_validator(mode="after")
    def _unique_endpoints(self) -> Pool:
        seen: set[str] = set()
        for url in self.endpoints:
            if url in seen:
                raise ValueError(f"endpoint {url} is listed twice")
            seen.add(url)
        if self.kv_events is not None:
            unknown = sorted(set(self.kv_events.sockets) - set(self.endpoints))
            if unknown:
                raise ValueError(f"kv_events.sockets names {', '.join(unknown)}, not an endpoint of the pool")
            for url in self.endpoints:
                try:
                    addresses = self.kv_events.addresses(url)
                except KeyError:
                    raise ValueError(f"kv_events: no sockets for endpoint {url} (give `port`, `port_offset` "
                                     "or its `sockets`)") from None
                for address in addresses:
                    if address and address.startswith("tcp://"):
                        port = int(address.rsplit(":", 1)[1])
                        if not 1 <= port <= 65535:
                            raise ValueError(f"kv_events: endpoint {url} gives port {port}, outside 1-65535")
        return self


class Price(Strict):
    """Prices per million tokens, in the operator's currency (USD in the demo)."""

    input_per_mtok: NonNegativeFloat
    output_per_mtok: NonNegativeFloat = Field(
        default=0.0, description="Required for generating models; an embedding model's answers have no output "
        "tokens.")
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


#: The built-in tokenizer ``models[].tokenizer`` may name instead of a file: the stand-in tokenizer (and chat
#: template) of ``switchyard sim``'s engines, so a gateway in front of simulated engines computes their token ids.
SIM_TOKENIZER = "switchyard-sim"


def _check_tokenizer_path(path: str) -> str:
    if "://" in path:
        raise ValueError(f"tokenizer {path!r} must be a local file path (tokenizers are never downloaded)")
    return path


def _check_chat_template_path(path: str) -> str:
    if "://" in path:
        raise ValueError(f"chat_template {path!r} must be a local file path (templates are never downloaded)")
    return path


TokenizerPath = Annotated[str, StringConstraints(min_length=1), AfterValidator(_check_tokenizer_path)]
ChatTemplatePath = Annotated[str, StringConstraints(min_length=1), AfterValidator(_check_chat_template_path)]


class OnSaturation(Strict):
    """What to do when every pool of a model is saturated: serve chosen classes with a cheaper model."""

    downgrade_to: ModelName = Field(description="The model that serves the request instead.")
    classes: list[Name] | None = Field(
        default=None, min_length=1, description="Priority classes that may be downgraded (default: all).")
    at_utilisation: float = Field(
        default=1.0, gt=0, le=1, description="Downgrade once every pool of the model is at least this full "
        "(default 1: saturated). Below 1 the downgraded classes leave the rest of the model's pools to the classes "
        "that are not downgraded, so that a burst of those finds room at once instead of waiting for a slot; "
        "while the cheaper model has no room they still take it.")
    wait_for_either: bool = Field(
        default=False, description="When both models are saturated, a request of these classes waits for the "
        "model's pools and the cheaper model's alike and is served by whichever frees first (default: it waits "
        "for the model's own pools only).")


class Model(Strict):
    """What clients put in ``model``: a concrete model served by one or more pools."""

    name: ModelName
    kind: Literal["generate", "embedding"] = Field(
        default="generate", description="`embedding`: an embedding model, served at `/v1/embeddings` by pools of "
        "`task: embed` (priced per input token: give `price.input_per_mtok`). `generate` (the default): chat and "
        "text completions, the Responses API, by pools of `task: generate`.")
    pools: list[Name] = Field(default_factory=list, description="The pools that serve it (an adapter's default: "
                              "its `adapter_of` pool).")
    adapter_of: Name | None = Field(
        default=None, description="A LoRA adapter served on this pool's base model: requests go to the pool's "
        "replicas, named by `adapter` (the name vLLM serves the adapter under).")
    adapter: str | None = Field(
        default=None, min_length=1, max_length=256, description="With `adapter_of`: the adapter's name as vLLM "
        "serves it (`--lora-modules NAME=PATH`, or `lora_name` when loaded at run time; default: the model's name).")
    adapter_path: str | None = Field(
        default=None, min_length=1, max_length=4096, description="With `adapter_of`: where the replicas find the "
        "adapter (`lora_path`), for pools with `runtime_lora_loading`: the gateway loads it on a replica before "
        "the first request it sends there. A path on the engines' machines, never fetched by the gateway.")
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
        "are then counted with it instead of estimated, and turned into the token ids the engine caches. A local "
        f"file: it is never downloaded. `{SIM_TOKENIZER}` names the simulator's built-in stand-in tokenizer (and "
        "its chat template), for pools of `switchyard sim` engines.",
    )
    chat_template: ChatTemplatePath | None = Field(
        default=None,
        description="Path of the served model's Jinja chat template, relative to the policy file's folder (a "
        "local file), for turning chat requests into the engine's token ids. Default: the `chat_template.jinja` "
        "beside the tokenizer.json, else the `chat_template` of the `tokenizer_config.json` beside it, as a "
        f"Hugging Face model folder has them. Needs a `tokenizer` file; `{SIM_TOKENIZER}` has its own template.",
    )
    on_saturation: OnSaturation | list[OnSaturation] | None = Field(
        default=None, description="Degrade before refusing: when the model's pools are saturated, requests "
        "of the chosen classes are served by `downgrade_to` instead of queueing or being shed. A list gives "
        "classes rules of their own (another model, another `at_utilisation`): a request follows the first rule "
        "that names its class (or names none).")
    endpoint_profile: Name | None = Field(
        default=None, description="The `endpoint_profiles` entry that picks this model's endpoints (default: "
        "Switchyard's built-in profile).")
    first_token_timeout: Duration | None = Field(
        default=None, description="This model's first-token timeout for streamed answers (default: "
        "`resilience.first_token_timeout`); a class's `first_token_deadline` or `ttft_objective` takes precedence.")
    resume_streams: bool = Field(
        default=True, description="A stream its engine breaks off (connection lost, an error event, a stall) is "
        "continued on the next endpoint of the fallback plan: the text so far is sent as a final assistant "
        "message to continue (vLLM's `continue_final_message`; for completions, the prompt plus the text so far) "
        "and the continuation is spliced into the client's stream. Set false for engines that cannot continue "
        "a message: a broken stream then ends with an error event.")
    max_resumes: int = Field(default=2, ge=0, le=10, description="Most resumes of one request's stream.")

    @property
    def saturation_rules(self) -> tuple[OnSaturation, ...]:
        """``on_saturation`` as a list of rules (none, one, or the list given)."""
        rules = self.on_saturation
        if rules is None:
            return ()
        return (rules,) if isinstance(rules, OnSaturation) else tuple(rules)

    def saturation_rule(self, class_name: str) -> OnSaturation | None:
        """The first ``on_saturation`` rule that applies to ``class_name`` (None: the class is never downgraded)."""
        for rule in self.saturation_rules:
            if rule.classes is None or class_name in rule.classes:
                return rule
        return None

    @property
    def served_name(self) -> str | None:
        """The name the engines serve this model under when it is not the pool's ``served_model`` (an adapter's)."""
        if self.adapter_of is None:
            return None
        return self.adapter or self.name

    @model_validator(mode="before")
    @classmethod
    def _adapter_pool(cls, data: object) -> object:
        """An adapter's pools default to its base pool."""
        if isinstance(data, dict) and isinstance(data.get("adapter_of"), str) and not data.get("pools"):
            return {**data, "pools": [data["adapter_of"]]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Model:
        if self.adapter_of is not None:
            if self.pools != [self.adapter_of]:
                raise ValueError(f"an adapter is served by its base pool only: leave out pools, or give "
                                 f"[{self.adapter_of}]")
            if self.kind == "embedding":
                raise ValueError("an embedding model cannot be a LoRA adapter (adapter_of)")
        elif self.adapter is not None or self.adapter_path is not None:
            raise ValueError("adapter and adapter_path need adapter_of (the base pool)")
        if not self.pools:
            raise ValueError("a model needs pools (or adapter_of)")
        if self.kind == "generate" and "output_per_mtok" not in self.price.model_fields_set:
            raise ValueError("price.output_per_mtok is required (only embedding models may leave it out)")
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
        if self.chat_template is not None and self.tokenizer in (None, SIM_TOKENIZER):
            raise ValueError("chat_template needs a tokenizer file (the simulator's tokenizer has its own template)"
                             if self.tokenizer else "chat_template needs a tokenizer")
        return self
