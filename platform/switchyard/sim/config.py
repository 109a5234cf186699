"""Engine configuration: what the command line gives, resolved against a hardware profile."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from switchyard.kvcache.config import KVEventsConfig, parse
from switchyard.kvcache.publisher import config_for
from switchyard.sim.lora import LoraModule, LoraSettings, lora_settings, runtime_updating_from_env
from switchyard.sim.profiles import EngineProfile, get_profile


@dataclass(frozen=True)
class EngineConfig:
    """One simulated engine, as ``switchyard sim`` is told to run it.

    Attributes:
        served_model: Model name clients put in ``model`` (vLLM's ``--served-model-name``).
        port: TCP port to listen on.
        host: Interface to listen on.
        profile: Hardware profile: a built-in name (see ``PROFILES``), the name of a shipped
            measured profile, or the path of a profile file (``.json``/``.yaml``).
        max_model_len: Context window; None for the profile's default.
        kv_cache_tokens: KV-cache capacity in tokens; None for the profile's default.
        max_num_seqs: Most running sequences; None for the profile's default.
        time_scale: Simulated seconds per wall-clock second (10 = ten times faster).
        seed: Seed of the generated text and of fault injection.
        region: Region label (the policy pool's region), for targeting faults; None if unlabelled.
        pool: Pool label (the policy pool's name), for targeting faults; None if unlabelled.
        kv_events: vLLM's ``--kv-events-config`` for this engine (its own endpoints); None
            publishes nothing.
        enable_lora: vLLM's ``--enable-lora``: requests may name an adapter as their ``model``.
        max_loras: ``--max-loras``: most distinct adapters in one batch (None: vLLM's 1).
        max_cpu_loras: ``--max-cpu-loras``: adapters kept in the CPU cache (None: ``max_loras``).
        lora_modules: ``--lora-modules``: adapters registered at start-up.
        allow_runtime_lora: Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
            (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); None reads that variable, as vLLM does.
    """

    served_model: str
    port: int
    host: str = "127.0.0.1"
    profile: str = "h100-8b"
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    max_num_seqs: int | None = None
    time_scale: float = 1.0
    seed: int = 0
    region: str | None = None
    pool: str | None = None
    kv_events: KVEventsConfig | None = None
    enable_lora: bool = False
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    lora_modules: tuple[LoraModule, ...] = ()
    allow_runtime_lora: bool | None = None


@dataclass(frozen=True)
class ResolvedConfig:
    """An ``EngineConfig`` with every default filled in and every limit checked."""

    served_model: str
    host: str
    port: int
    profile: EngineProfile
    max_model_len: int
    kv_cache_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    time_scale: float
    seed: int
    region: str | None = None
    pool: str | None = None
    kv_events: KVEventsConfig | None = None
    #: The LoRA settings, None without ``enable_lora``.
    lora: LoraSettings | None = None
    #: Whether the load/unload endpoints are served.
    allow_runtime_lora: bool = False

    @property
    def url(self) -> str:
        """Base URL of the engine (``http://host:port``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def describe(self) -> str:
        """The one line printed when the engine listens."""
        labels = "".join(f", {name} {value}" for name, value in (("pool", self.pool), ("region", self.region))
                         if value is not None)
        events = self.kv_events
        if events is not None and events.publishing:
            replay = f", replay {events.replay_endpoint}" if events.replay_endpoint else ""
            labels += f", kv events {events.endpoint}{replay}"
        if self.lora is not None:
            runtime = ", runtime loading" if self.allow_runtime_lora else ""
            labels += f", lora {len(self.lora.modules)} adapters (max_loras {self.lora.max_loras}{runtime})"
        return (f"sim: {self.served_model} on http://{self.host}:{self.port} "
                f"(profile {self.profile.name}, kv {self.kv_cache_tokens} tokens, "
                f"max_model_len {self.max_model_len}{labels})")


def resolve(config: EngineConfig) -> ResolvedConfig:
    """Fill in profile defaults and validate.

    Raises:
        ValueError: With a message naming the bad setting.
    """
    if not config.served_model:
        raise ValueError("sim: the served model name must not be empty")
    if not 0 <= config.port <= 65535:
        raise ValueError(f"sim: port {config.port} is not a valid TCP port")
    if not config.time_scale > 0:
        raise ValueError(f"sim: time_scale must be > 0, got {config.time_scale}")
    profile = get_profile(config.profile)
    kv = config.kv_cache_tokens if config.kv_cache_tokens is not None else profile.kv_cache_tokens
    if kv < profile.block_size:
        raise ValueError(f"sim: kv_cache_tokens must be at least one block "
                         f"({profile.block_size} tokens), got {kv}")
    kv -= kv % profile.block_size
    if config.max_model_len is None:
        # Like vLLM with a small --gpu-memory-utilization: the default shrinks to what fits.
        max_len = min(profile.max_model_len, kv)
    else:
        max_len = config.max_model_len
        if max_len < 2:
            raise ValueError(f"sim: max_model_len must be at least 2, got {max_len}")
        if max_len > kv:
            raise ValueError(
                f"sim: max_model_len {max_len} is larger than the KV cache can hold "
                f"({kv} tokens); raise kv_cache_tokens or lower max_model_len")
    events = config.kv_events
    if events is not None and events.enable_kv_cache_events and events.publisher not in ("zmq", "null"):
        raise ValueError(f"sim: unknown KV events publisher {events.publisher!r} (zmq or null)")
    seqs = config.max_num_seqs if config.max_num_seqs is not None else profile.max_num_seqs
    if seqs < 1:
        raise ValueError(f"sim: max_num_seqs must be at least 1, got {seqs}")
    lora: LoraSettings | None = None
    if config.enable_lora:
        lora = lora_settings(max_loras=config.max_loras, max_cpu_loras=config.max_cpu_loras,
                             modules=config.lora_modules, served_model=config.served_model)
    elif config.lora_modules:
        raise ValueError("sim: --lora-modules needs --enable-lora")
    runtime = runtime_updating_from_env() if config.allow_runtime_lora is None else config.allow_runtime_lora
    return ResolvedConfig(
        served_model=config.served_model, host=config.host, port=config.port, profile=profile,
        max_model_len=max_len, kv_cache_tokens=kv, max_num_seqs=seqs,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        time_scale=config.time_scale, seed=config.seed, region=config.region, pool=config.pool,
        kv_events=events, lora=lora, allow_runtime_lora=runtime)


def with_pool_adapters(config: EngineConfig, adapters: Sequence[tuple[str, str | None]], *,
                       max_loras: int | None = None, runtime_loading: bool = False) -> EngineConfig:
    """A policy pool's engine with LoRA as the pool asks (``switchyard sim --policy``).

    The engines enable LoRA when the pool serves adapters or sets ``max_loras``. With runtime loading they
    start with no adapter and serve the load/unload endpoints (the gateway loads what it sends); without,
    they start with the pool's adapters registered, as ``--lora-modules``. Without either, ``config`` is
    returned as is.

    Args:
        config: The pool endpoint's engine.
        adapters: (served name, path) of each model that is an adapter of the pool; a path left out is
            the name (vLLM reads a path that is no directory as a Hugging Face repository id).
        max_loras: The pool's ``max_loras`` (None: vLLM's default).
        runtime_loading: The pool's ``runtime_lora_loading``.
    """
    if not adapters and max_loras is None:
        return config
    modules = () if runtime_loading else tuple(LoraModule(name, path or name) for name, path in adapters)
    return dataclasses.replace(config, enable_lora=True, max_loras=max_loras, lora_modules=modules,
                               allow_runtime_lora=runtime_loading)


def with_kv_events(configs: Sequence[EngineConfig], kv_events_config: str) -> list[EngineConfig]:
    """The engines of one process, each publishing KV events per the ``--kv-events-config`` JSON.

    The Nth engine (from 0) gets both endpoints offset by N, as vLLM offsets them per
    data-parallel rank: a TCP port plus N (port 0 stays 0), an ``ipc://``/``inproc://`` name
    plus ``_dpN``.

    Raises:
        ValueError: The JSON is not a valid config, or an endpoint cannot be offset.
    """
    events = parse(kv_events_config)
    return [dataclasses.replace(c, kv_events=config_for(events, i)) for i, c in enumerate(configs)]
