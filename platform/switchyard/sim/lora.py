"""LoRA adapters as vLLM 0.32 serves them: the registry, the engine's adapter caches, their costs.

Three parts, each where vLLM keeps it:

* ``LoraRegistry`` is the API server's list of adapters (vLLM's ``OpenAIServingModels.lora_requests``):
  the ``--lora-modules`` given at start-up, then ``POST /v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter`` (with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). Each name gets an integer id
  from a counter that starts at 1 and never goes back; a request whose ``model`` is a registered name
  runs on the base model with that adapter. Unloading only forgets the name: as in vLLM, the engine
  keeps the adapter's weights until its caches evict them.
* ``LoraEngine`` is the engine core's side. Adapters live in two LRU caches keyed by id: the CPU cache
  (``--max-cpu-loras``, weights read from disk) and the GPU slots (``--max-loras``). Before each step,
  every adapter of the batch is made resident, in batch order, as vLLM's ``LRUCacheWorkerLoRAManager``
  does: one not in the CPU cache is read (``lora_load_s``; the oldest CPU entry goes, and leaves its GPU
  slot with it), one without a GPU slot is copied in (``lora_activate_s``; the oldest slot is freed),
  and each distinct adapter of the batch adds ``lora_step_overhead_s`` to the step. It also keeps what
  the scheduler and the metrics need: the waiting requests skipped for the adapter limit (vLLM's
  ``deferred_waiting``), the adapters with requests in flight in the order the API server first saw
  their output (vLLM's ``LoRARequestStates``), and when each ``vllm:lora_requests_info`` label set
  was last written.
* The cost model's defaults: an adapter's size from the model's shapes, and the three costs from it.

Must not touch: the scheduler's queues (``core`` decides; this module answers what an adapter costs and
whether it is resident) or anything outside the simulator.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from switchyard.sim.request import SimRequest

#: vLLM's environment switch for the load/unload endpoints (``vllm/envs.py``: "1" or "true", any case).
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
#: vLLM's ``--max-loras`` default (``vllm/config/lora.py``).
DEFAULT_MAX_LORAS = 1
#: vLLM's ``--max-lora-rank`` default: the rank the default costs assume.
DEFAULT_RANK = 16


def runtime_updating_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` allows the load/unload endpoints, read as vLLM reads it."""
    env = os.environ if environ is None else environ
    return env.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


# --- costs -----------------------------------------------------------------------------------------


def adapter_bytes(*, hidden: int, intermediate: int, layers: int, q_dim: int, kv_dim: int,
                  rank: int = DEFAULT_RANK, dtype_bytes: int = 2) -> int:
    """Bytes of a LoRA adapter on every linear layer of a Llama-style decoder layer.

    Each of q, k, v, o, gate, up and down gets A (in x rank) and B (rank x out), as PEFT's
    ``target_modules="all-linear"`` makes them; BF16 weights.
    """
    pairs = ((hidden, q_dim), (hidden, kv_dim), (hidden, kv_dim), (q_dim, hidden),
             (hidden, intermediate), (hidden, intermediate), (intermediate, hidden))
    return rank * sum(i + o for i, o in pairs) * layers * dtype_bytes


#: Reading an adapter file into CPU tensors, bytes/s. Assumption: safetensors from local NVMe at
#: ~2 GB/s (a datacenter NVMe reads 3-7 GB/s sequentially; PEFT's loader converts tensor by tensor).
ADAPTER_READ_BYTES_S = 2e9
#: Fixed cost of a load besides reading: parsing ``adapter_config.json``, matching module names and
#: building the ``LoRAModel`` (a few hundred tensors). Assumption: 20 ms.
ADAPTER_LOAD_FIXED_S = 0.020
#: Host-to-device copy rate of an activation, bytes/s per GPU. Assumption: half of PCIe Gen5 x16's
#: 64 GB/s, as the weights go one module slice at a time.
ADAPTER_COPY_BYTES_S = 25e9


@dataclass(frozen=True, slots=True)
class LoraCosts:
    """What adapters cost one engine, in seconds.

    Attributes:
        load_s: Reading an adapter that is not in the CPU cache (disk to CPU, then to its GPU slot).
        activate_s: Copying an adapter from the CPU cache into a free GPU slot.
        step_s: Per distinct adapter in a step: the LoRA kernels read its A and B matrices once.
    """

    load_s: float
    activate_s: float
    step_s: float


def lora_costs(size: int, *, gpus: int, hbm_bytes_s: float) -> LoraCosts:
    """The costs of an adapter of ``size`` bytes, split over ``gpus`` tensor-parallel GPUs.

    Args:
        size: The adapter's bytes (``adapter_bytes``).
        gpus: GPUs in the tensor-parallel group: each holds and reads 1/gpus of it.
        hbm_bytes_s: Achieved HBM bandwidth of the whole group (the profile's decode figure).
    """
    activate = size / gpus / ADAPTER_COPY_BYTES_S
    return LoraCosts(load_s=ADAPTER_LOAD_FIXED_S + size / ADAPTER_READ_BYTES_S + activate,
                     activate_s=activate, step_s=size / hbm_bytes_s)


#: A rank-16 all-linear adapter of Llama-3.1-8B (its config.json: hidden 4096, intermediate 14336,
#: 32 layers, 32 query and 8 KV heads of 128): 83,886,080 bytes (80 MiB).
LLAMA_8B_ADAPTER_BYTES = adapter_bytes(hidden=4096, intermediate=14336, layers=32, q_dim=4096, kv_dim=1024)
#: The costs of that adapter on one H100 SXM (3.35 TB/s HBM3 at the 80% the h100-8b profile assumes):
#: load 0.065 s, activate 3.4 ms, 31 us per step. The default of every profile that does not say.
DEFAULT_LORA_COSTS = lora_costs(LLAMA_8B_ADAPTER_BYTES, gpus=1, hbm_bytes_s=3.35e12 * 0.80)


# --- configuration ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoraModule:
    """One ``--lora-modules`` entry: an adapter registered at start-up.

    Attributes:
        name: The name requests put in ``model``.
        path: Where the engine reads it (a directory or a Hugging Face repository id).
        base_model_name: The ``parent`` it is listed under, if not the served model.
    """

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(items: Iterable[str]) -> tuple[LoraModule, ...]:
    """``--lora-modules`` values as vLLM reads them: ``name=path``, or a JSON object
    ``{"name", "path", "base_model_name"?}``; empty items are skipped.

    Raises:
        ValueError: An item is neither (the message quotes it, as vLLM's parser does).
    """
    modules: list[LoraModule] = []
    for item in items:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, path = item.split("=", 1)
            modules.append(LoraModule(name, path))
            continue
        try:
            data = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        fields = {"name", "path", "base_model_name", "is_3d_lora_weight"}
        if (not isinstance(data, dict) or not {"name", "path"} <= data.keys() or not data.keys() <= fields
                or not all(isinstance(data.get(k), str) for k in ("name", "path"))):
            raise ValueError(f"Invalid fields for --lora-modules: {item}")
        base = data.get("base_model_name")
        modules.append(LoraModule(data["name"], data["path"], base if isinstance(base, str) else None))
    return tuple(modules)


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """An engine's resolved LoRA configuration (``--enable-lora`` and what goes with it).

    Attributes:
        max_loras: Most distinct adapters in one batch, and GPU slots.
        max_cpu_loras: Adapters the CPU cache holds (at least ``max_loras``).
        modules: The adapters registered at start-up, in order.
    """

    max_loras: int = DEFAULT_MAX_LORAS
    max_cpu_loras: int = DEFAULT_MAX_LORAS
    modules: tuple[LoraModule, ...] = ()


def lora_settings(*, max_loras: int | None, max_cpu_loras: int | None,
                  modules: Sequence[LoraModule], served_model: str) -> LoraSettings:
    """Check and complete the LoRA flags as vLLM does at start-up.

    Raises:
        ValueError: ``max_loras`` below 1, ``max_cpu_loras`` below ``max_loras``, an adapter whose name is
            taken (by the served model or by an earlier module), or one vLLM would fail to load from a path
            on this machine (``check_adapter_path``; vLLM refuses to start then, with the load's message).
    """
    loras = DEFAULT_MAX_LORAS if max_loras is None else max_loras
    if loras < 1:
        raise ValueError(f"sim: max_loras must be at least 1, got {loras}")
    # vLLM treats a max_cpu_loras of 0 or less as unset: the CPU cache then holds max_loras.
    cpu = loras if max_cpu_loras is None or max_cpu_loras <= 0 else max_cpu_loras
    if cpu < loras:
        raise ValueError(f"sim: max_cpu_loras ({cpu}) must be >= max_loras ({loras}).")
    seen: set[str] = set()
    for module in modules:
        if not module.name or not module.path:
            raise ValueError("sim: --lora-modules: Both 'lora_name' and 'lora_path' must be provided.")
        if module.name == served_model:
            raise ValueError(f"sim: --lora-modules: The lora adapter '{module.name}' conflicts with a served "
                             "base model.")
        if module.name in seen:
            raise ValueError(f"sim: --lora-modules: The lora adapter '{module.name}' has already been loaded.")
        try:  # vLLM loads each one before it serves, and stops at the first it cannot
            check_adapter_path(module.name, module.path)
        except LoraRequestError as exc:
            raise ValueError(f"sim: --lora-modules: {sanitize_message(exc.message)}") from None
        seen.add(module.name)
    return LoraSettings(loras, cpu, tuple(modules))


# --- the API server's registry ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    """A registered adapter, as a request carries it (vLLM's ``LoRARequest``).

    Attributes:
        name: ``lora_name``: what requests put in ``model``; KV events' ``lora_name``.
        int_id: ``lora_int_id``: the engine's key for it; KV events' ``lora_id``.
        path: ``lora_path``: part of its KV blocks' hash and its ``root`` in ``/v1/models``.
        parent: The base model it is listed under in ``/v1/models``.
    """

    name: str
    int_id: int
    path: str
    parent: str


class LoraRequestError(Exception):
    """A load or unload request vLLM refuses: its status, message and error type."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


#: What vLLM's ``sanitize_message`` replaces with "<path>" in an error message: absolute paths under the
#: usual roots, and any path ending in a file name with an extension.
_SYSTEM_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")
#: The files vLLM reads an adapter's weights from, in its order (``LoRAModel.from_local_checkpoint``).
_TENSOR_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")


def sanitize_message(message: str) -> str:
    """vLLM's ``sanitize_message`` (``entrypoints/serve/exception_handling/utils.py``), whose file paths
    every error response hides."""
    return _FILE_PATH.sub("<path>", _SYSTEM_PATH.sub("<path>", message)).strip()


def _worker_failed(error: object) -> LoraRequestError:
    """The 500 of an ``add_lora`` that failed in the worker for another reason than a missing adapter."""
    return LoraRequestError(500, f"Call to add_lora method failed: Worker failed with error '{error}', please "
                            "check the stack trace above for the root cause", "InternalServerError")


def _simulated_path(path: str) -> bool:
    """Whether ``path`` names an adapter the simulator makes up instead of reading it from this machine:
    nothing is there, and no directory of this machine would hold it either (its parent directory does not
    exist, or is the root: ``/adapters/support-v1``, ``/a``), or it is a relative name, which vLLM takes for
    a Hugging Face repository id."""
    if os.path.exists(path):
        return False
    if not os.path.isabs(path):
        return True
    parent = os.path.dirname(os.path.normpath(path))
    return not os.path.isdir(parent) or os.path.dirname(parent) == parent


def check_adapter_path(name: str, path: str) -> None:
    """What vLLM's worker finds when it loads adapter ``name`` from ``path`` (``_load_adapter``), for a path
    on this machine.

    A path the simulator cannot check is a simulated adapter and is accepted (``_simulated_path``: policies
    and tests name made-up directories such as ``/adapters/support-v1``). A path that exists here, or that
    would be in a directory that does, is read as vLLM reads it: ``adapter_config.json`` must be a JSON file
    in that directory, and one of the weight files must be next to it; the weights themselves are not read.

    Raises:
        LoraRequestError: vLLM's 404 "No adapter found" (the path or its ``adapter_config.json`` does not
            exist), or its 500 for anything else the worker fails on (the path is a file, the config no
            JSON, no weights), with vLLM's wording, file paths not yet hidden.
    """
    local = os.path.expanduser(path) if path.startswith("~") else path
    if not os.path.isabs(local) and os.path.exists(local):
        local = os.path.abspath(local)
    if _simulated_path(local):
        return
    try:
        with open(os.path.join(local, "adapter_config.json")) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoraRequestError(404, f"Loading lora {name} failed: No adapter found for {path}",
                               "NotFoundError") from None
    except (OSError, ValueError) as exc:  # a file, not a directory; a config that is a directory, or no JSON
        raise _worker_failed(exc) from None
    if isinstance(config, dict) and not any(os.path.isfile(os.path.join(local, f)) for f in _TENSOR_FILES):
        raise _worker_failed(f"{local} doesn't contain tensors")


class LoraRegistry:
    """The adapters the API server knows by name (vLLM's ``OpenAIServingModels``).

    Args:
        served_model: The base model's served name (an adapter may not take it).
        modules: The ``--lora-modules`` adapters, registered in order (ids 1, 2, …).
    """

    def __init__(self, served_model: str, modules: Sequence[LoraModule] = ()) -> None:
        self.served_model = served_model
        self.adapters: dict[str, LoraAdapter] = {}
        self._last_id = 0
        for module in modules:
            self.load(module.name, module.path)

    def get(self, name: object) -> LoraAdapter | None:
        """The adapter a request's ``model`` names, if it names one."""
        return self.adapters.get(name) if isinstance(name, str) else None

    def _next_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def load(self, name: str, path: str, *, load_inplace: bool = False) -> LoraAdapter:
        """Register ``name`` (``POST /v1/load_lora_adapter``): a new id, or its old one when reloaded in place.

        Raises:
            LoraRequestError: As ``check_load``.
        """
        self.check_load(name, path, load_inplace=load_inplace)
        previous = self.adapters.get(name)
        int_id = previous.int_id if previous is not None else self._next_id()
        # vLLM lists an adapter under its base_model_name only when that is a served name: here, always
        # the one served model.
        adapter = LoraAdapter(name, int_id, path, self.served_model)
        self.adapters[name] = adapter
        return adapter

    def check_load(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        """vLLM's checks of a load request, made before the engine is asked.

        Raises:
            LoraRequestError: vLLM's 400s: a name or path missing, the base model's name, a name already
                loaded (without ``load_inplace``).
        """
        if not name or not path:
            raise LoraRequestError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name == self.served_model:
            raise LoraRequestError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                                   "InvalidUserInput")
        if name in self.adapters and not load_inplace:
            raise LoraRequestError(400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                                   "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput")

    def unload(self, name: str) -> LoraAdapter:
        """Forget ``name`` (``POST /v1/unload_lora_adapter``); the engine keeps its weights cached.

        Raises:
            LoraRequestError: vLLM's 400 for an empty name, 404 for a name not loaded.
        """
        if not name:
            raise LoraRequestError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                                   "InvalidUserInput")
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraRequestError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return adapter

    def spend_id(self) -> None:
        """Use up an id without registering anything, as vLLM does when a load fails in the engine and when
        a request names an unknown model while runtime updating is on (it asks its LoRA resolvers, none of
        which is installed)."""
        self._next_id()

    @staticmethod
    def added_message(name: str) -> str:
        """vLLM's answer to a successful load."""
        return f"Success: LoRA adapter '{name}' added successfully."

    @staticmethod
    def removed_message(name: str) -> str:
        """vLLM's answer to a successful unload."""
        return f"Success: LoRA adapter '{name}' removed successfully."


# --- the engine's side -----------------------------------------------------------------------------


class LoraEngine:
    """The engine core's adapter state: GPU slots and CPU cache (LRU, by id), and the scheduler's and
    metrics' bookkeeping.

    Args:
        settings: Slots and cache size.
        costs: What loading, activating and running an adapter cost.
    """

    def __init__(self, settings: LoraSettings, costs: LoraCosts) -> None:
        self.max_loras = settings.max_loras
        self.max_cpu_loras = settings.max_cpu_loras
        self.costs = costs
        #: Adapters in GPU slots, least recently used first.
        self.gpu: OrderedDict[int, LoraAdapter] = OrderedDict()
        #: Adapters in the CPU cache, least recently used first (every GPU-resident one is here too).
        self.cpu: OrderedDict[int, LoraAdapter] = OrderedDict()
        self.loads = 0
        self.activations = 0
        self.load_seconds = 0.0
        #: Waiting requests the scheduler skipped for the adapter limit and has not scheduled since.
        self.deferred: dict[SimRequest, None] = {}
        #: Requests in flight per adapter name, from their first token, in first-seen order.
        self.in_flight: dict[str, int] = {}
        #: ``vllm:lora_requests_info``: each adapter list written, and the simulated time it last was.
        self.info: dict[str, float] = {}
        #: Seconds of adapter loading (runtime ``add_lora`` calls) the next step waits for.
        self.pending_s = 0.0
        #: The engine was idle when an adapter was loaded: no step starts before this time.
        self.busy_until = 0.0

    # --- residency --------------------------------------------------------------------------------

    def _make_resident(self, adapter: LoraAdapter, reload: bool = False) -> float:
        """What vLLM's ``add_adapter`` then ``activate_adapter`` do for one adapter; returns the seconds."""
        cpu, gpu = self.cpu, self.gpu
        key = adapter.int_id
        seconds = 0.0
        if key not in cpu or reload:
            seconds += self.costs.load_s - self.costs.activate_s
            self.loads += 1
            if key in cpu:  # an in-place reload replaces the weights, slot included
                del cpu[key]
                gpu.pop(key, None)
            elif len(cpu) + 1 > self.max_cpu_loras:
                old, _ = cpu.popitem(last=False)
                gpu.pop(old, None)  # a CPU eviction frees its GPU slot too
            cpu[key] = adapter
        else:
            cpu.move_to_end(key)
        if key not in gpu:
            if len(gpu) >= self.max_loras:
                gpu.popitem(last=False)
            seconds += self.costs.activate_s
            self.activations += 1
            gpu[key] = adapter
        else:
            gpu.move_to_end(key)
        self.load_seconds += seconds
        return seconds

    def preload(self, adapter: LoraAdapter) -> None:
        """Make an adapter resident at start-up (vLLM loads each ``--lora-modules`` entry before it serves):
        counted as a load, but not in ``load_seconds``, the time loads took from serving."""
        spent = self._make_resident(adapter)
        self.load_seconds -= spent

    def add_lora(self, adapter: LoraAdapter, at: float, engine_busy: bool, reload: bool = False) -> float:
        """The engine's ``add_lora`` call of a runtime load: the adapter is read and takes a GPU slot.

        Args:
            adapter: The adapter.
            at: Simulated time of the call.
            engine_busy: Whether the engine has requests (the load then delays its next step).
            reload: Read it again even if cached (``load_inplace``).

        Returns:
            Simulated time the load completes.
        """
        seconds = self._make_resident(adapter, reload)
        if engine_busy:
            self.pending_s += seconds
        else:
            self.busy_until = max(self.busy_until, at) + seconds
            return self.busy_until
        return at + seconds

    def prepare(self, adapters: Iterable[LoraAdapter]) -> float:
        """Make a step's adapters resident, in batch order; the seconds they add to the step (loads,
        copies, the per-adapter overhead, and any runtime load it waited for)."""
        seconds, self.pending_s = self.pending_s, 0.0
        seen: set[int] = set()
        for adapter in adapters:
            if adapter.int_id not in seen:
                seen.add(adapter.int_id)
                seconds += self._make_resident(adapter) + self.costs.step_s
        return seconds

    def decode_overhead(self, batch: Iterable[SimRequest]) -> float | None:
        """The seconds a pure-decode step of ``batch`` adds, or None if such a step would load, copy or
        wait for something (the fast path then steps one at a time)."""
        if self.pending_s:
            return None
        ids = {r.lora.int_id for r in batch if r.lora is not None}
        if not ids.issubset(self.gpu):
            return None
        return self.costs.step_s * len(ids)

    def touch(self, batch: Iterable[SimRequest]) -> None:
        """Refresh the caches' LRU order as a run of steps of ``batch`` does (all resident): each distinct
        adapter once, in batch order, as ``prepare``."""
        seen: set[int] = set()
        for r in batch:
            if r.lora is not None and r.lora.int_id not in seen:
                seen.add(r.lora.int_id)
                self.cpu.move_to_end(r.lora.int_id)
                self.gpu.move_to_end(r.lora.int_id)

    # --- what the metrics see -----------------------------------------------------------------------

    def track(self, req: SimRequest) -> None:
        """A request's first token reached the API server: its adapter counts as in flight."""
        if req.lora is not None:
            name = req.lora.name
            self.in_flight[name] = self.in_flight.get(name, 0) + 1

    def untrack(self, req: SimRequest, started: bool) -> None:
        """A request finished or was aborted (``started``: it had produced its first token)."""
        self.deferred.pop(req, None)
        if started and req.lora is not None:
            name = req.lora.name
            left = self.in_flight.get(name, 0) - 1
            if left > 0:
                self.in_flight[name] = left
            else:
                self.in_flight.pop(name, None)

    def record(self, t: float) -> None:
        """One step's stats reached the metrics at simulated time ``t`` (vLLM sets the gauge each step)."""
        self.info[",".join(self.in_flight)] = t

    def snapshot(self) -> dict[str, object]:
        """The engine side for ``/sim/state``."""
        return {
            "max_loras": self.max_loras, "max_cpu_loras": self.max_cpu_loras,
            "gpu": [a.name for a in self.gpu.values()], "cpu": [a.name for a in self.cpu.values()],
            "loads": self.loads, "activations": self.activations, "load_seconds": self.load_seconds,
            "deferred": len(self.deferred), "in_flight": dict(self.in_flight),
            "costs": {"load_s": self.costs.load_s, "activate_s": self.costs.activate_s,
                      "step_s": self.costs.step_s},
        }
