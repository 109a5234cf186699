"""Measured profiles: a step-time model in seconds, and the profile file that holds one.

A built-in profile (``profiles.py``) derives its costs from published hardware figures. A
measured profile holds the same cost model with every coefficient in seconds, fitted by
``switchyard sim calibrate`` to what a real engine did, and says in its ``provenance`` where
each number came from (the engine, the date, the fit and its quality).

The step-time model is the roofline's shape, with its terms measured instead of derived::

    step = step_s + per_seq_s * seqs
           + max(per_token_s * tokens + per_attn_pair_s * pairs,     # compute side
                 weights_s + per_kv_token_s * kv_read_tokens)        # memory side

A bandwidth-bound engine (a GPU in decode) sits on the memory side, a compute-bound one (a
GPU in a long prefill, or a CPU) on the compute side; a side that never binds fits to zero.

Files are JSON (``.json``) or YAML (``.yaml``/``.yml``), with the same fields::

    format: switchyard.sim.profile/1
    name, model, hardware: strings
    limits: {block_size, kv_cache_tokens, max_model_len, max_num_seqs,
             max_num_batched_tokens, vocab_size}
    step_time: {step_s, per_seq_s, per_token_s, per_attn_pair_s, weights_s, per_kv_token_s}
    frontend_overhead_s: seconds between a request reaching the server and the scheduler
    idle_wakeup_s: extra seconds before an idle engine's first step (optional, default 0)
    lora: {load_s, activate_s, step_s}: LoRA adapter costs (optional; default: a rank-16 adapter of
          an 8B model on one H100, see ``lora.py``)
    provenance: free-form mapping (sources of each coefficient, fit quality, engine, date)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from switchyard.sim.lora import DEFAULT_LORA_COSTS

#: The ``format`` value this version reads and writes.
PROFILE_FORMAT = "switchyard.sim.profile/1"
#: File name endings that hold a profile.
PROFILE_SUFFIXES = (".json", ".yaml", ".yml")


class ProfileFileError(ValueError):
    """A profile file is missing, unreadable or invalid (the message names file and field)."""


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Seconds one engine step takes, from what it computes (see the module docstring).

    Attributes:
        step_s: Fixed cost of a step (scheduling, launches, sampling set-up).
        per_seq_s: Cost per scheduled sequence (input preparation, sampling, output).
        per_token_s: Compute cost per computed token (the weight matmuls).
        per_attn_pair_s: Compute cost per (query token, context token) attention pair.
        weights_s: Memory-side constant: reading the weights once.
        per_kv_token_s: Memory-side cost per context token whose KV is read.
    """

    step_s: float
    per_seq_s: float
    per_token_s: float
    per_attn_pair_s: float
    weights_s: float
    per_kv_token_s: float

    def roofline(self, num_tokens: int, kv_read_tokens: int, attn_pairs: int) -> tuple[float, float]:
        """A step's two roofline terms in seconds: its compute (matmuls and attention) and its memory traffic
        (weights once, and the KV it reads)."""
        compute = self.per_token_s * num_tokens + self.per_attn_pair_s * attn_pairs
        memory = self.weights_s + self.per_kv_token_s * kv_read_tokens
        return compute, memory

    def seconds(self, num_tokens: int, num_seqs: int, kv_read_tokens: int,
                attn_pairs: int) -> float:
        """Duration of one step; 0 for an empty one (same arguments as ``step_seconds``)."""
        if num_tokens <= 0:
            return 0.0
        return self.step_s + self.per_seq_s * num_seqs + max(self.roofline(num_tokens, kv_read_tokens, attn_pairs))

    def compute_share(self, num_tokens: int, kv_read_tokens: int, attn_pairs: int) -> float:
        """How much of a step's roofline term its compute is: 1.0 when the step is compute-bound (more tokens
        would lengthen it in proportion: the engine turns over all it can), less when reading weights and KV
        bounds it (tokens of more sequences would ride along almost for free); 0 for an empty step."""
        if num_tokens <= 0:
            return 0.0
        compute, memory = self.roofline(num_tokens, kv_read_tokens, attn_pairs)
        bound = max(compute, memory)
        return compute / bound if bound > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """The coefficients by name, in file order."""
        return {name: getattr(self, name) for name in STEP_TIME_FIELDS}


STEP_TIME_FIELDS = ("step_s", "per_seq_s", "per_token_s", "per_attn_pair_s", "weights_s",
                    "per_kv_token_s")


@dataclass(frozen=True)
class MeasuredProfile:
    """A profile whose costs were measured on a real engine (``switchyard sim calibrate``).

    It offers what the engine core reads from any profile (``step_seconds``,
    ``step_overhead_s``, ``frontend_overhead_s``, the limits), like ``HardwareProfile``.

    Attributes:
        name: Profile name (reported by ``/sim/state``).
        model: Model the profile describes (reported as ``root`` by ``/v1/models``).
        hardware: Human-readable description of the measured deployment.
        step_time: The fitted step-time coefficients.
        frontend_overhead_s: API-server time before a request reaches the scheduler.
        idle_wakeup_s: Extra delay before the first step of an idle engine.
        vocab_size: Token ids accepted in a prompt are ``0 <= id < vocab_size``.
        kv_cache_tokens: KV-cache capacity in tokens.
        max_model_len: Context window.
        max_num_seqs: Most running sequences.
        max_num_batched_tokens: Per-step token budget (chunked prefill).
        block_size: Tokens per KV block.
        provenance: Where every number came from (free-form, kept as read).
        lora_load_s: Reading a LoRA adapter not in the CPU cache into a GPU slot.
        lora_activate_s: Copying a CPU-cached adapter into a GPU slot.
        lora_step_overhead_s: Added to a step per distinct adapter in its batch.
    """

    name: str
    model: str
    hardware: str
    step_time: StepTimeModel
    frontend_overhead_s: float
    vocab_size: int
    kv_cache_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    idle_wakeup_s: float = 0.0
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    lora_load_s: float = DEFAULT_LORA_COSTS.load_s
    lora_activate_s: float = DEFAULT_LORA_COSTS.activate_s
    lora_step_overhead_s: float = DEFAULT_LORA_COSTS.step_s

    @property
    def step_overhead_s(self) -> float:
        """Time an empty step lets pass (nothing fit): the fixed per-step cost."""
        return self.step_time.step_s

    def step_seconds(self, num_tokens: int, num_seqs: int, kv_read_tokens: int,
                     attn_pairs: int) -> float:
        """Simulated duration of one engine step (see ``StepTimeModel.seconds``)."""
        return self.step_time.seconds(num_tokens, num_seqs, kv_read_tokens, attn_pairs)


# --- the file format ------------------------------------------------------------------------

Seconds = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=1)]


class _Limits(msgspec.Struct, forbid_unknown_fields=True):
    block_size: Count
    kv_cache_tokens: Count
    max_model_len: Annotated[int, msgspec.Meta(ge=2)]
    max_num_seqs: Count
    max_num_batched_tokens: Count
    vocab_size: Count


class _StepTime(msgspec.Struct, forbid_unknown_fields=True):
    step_s: Seconds
    per_seq_s: Seconds
    per_token_s: Seconds
    per_attn_pair_s: Seconds
    weights_s: Seconds
    per_kv_token_s: Seconds


class _LoraCosts(msgspec.Struct, forbid_unknown_fields=True):
    load_s: Seconds = DEFAULT_LORA_COSTS.load_s
    activate_s: Seconds = DEFAULT_LORA_COSTS.activate_s
    step_s: Seconds = DEFAULT_LORA_COSTS.step_s


class _ProfileDoc(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    name: Annotated[str, msgspec.Meta(min_length=1)]
    model: Annotated[str, msgspec.Meta(min_length=1)]
    hardware: str
    limits: _Limits
    step_time: _StepTime
    frontend_overhead_s: Seconds
    idle_wakeup_s: Seconds = 0.0
    lora: _LoraCosts | None = None
    provenance: dict[str, Any] = msgspec.field(default_factory=dict)


def profile_to_dict(profile: MeasuredProfile) -> dict[str, Any]:
    """The file representation of a profile (plain JSON types, in file order; ``lora`` only when set)."""
    doc: dict[str, Any] = {
        "format": PROFILE_FORMAT,
        "name": profile.name,
        "model": profile.model,
        "hardware": profile.hardware,
        "limits": {
            "block_size": profile.block_size,
            "kv_cache_tokens": profile.kv_cache_tokens,
            "max_model_len": profile.max_model_len,
            "max_num_seqs": profile.max_num_seqs,
            "max_num_batched_tokens": profile.max_num_batched_tokens,
            "vocab_size": profile.vocab_size,
        },
        "step_time": profile.step_time.as_dict(),
        "frontend_overhead_s": profile.frontend_overhead_s,
        "idle_wakeup_s": profile.idle_wakeup_s,
    }
    lora = {"load_s": profile.lora_load_s, "activate_s": profile.lora_activate_s,
            "step_s": profile.lora_step_overhead_s}
    if lora != {"load_s": DEFAULT_LORA_COSTS.load_s, "activate_s": DEFAULT_LORA_COSTS.activate_s,
                "step_s": DEFAULT_LORA_COSTS.step_s}:
        doc["lora"] = lora
    doc["provenance"] = dict(profile.provenance)
    return doc


def profile_from_dict(data: object, source: str = "<profile>") -> MeasuredProfile:
    """Validate a parsed profile document.

    Args:
        data: The parsed JSON or YAML document.
        source: What to name in error messages (a file name).

    Raises:
        ProfileFileError: The document is not a valid profile; the message names the field.
    """
    if not isinstance(data, Mapping):
        raise ProfileFileError(f"sim: profile {source}: expected a mapping at the top level, "
                               f"got {type(data).__name__}")
    fmt = data.get("format")
    if fmt != PROFILE_FORMAT:
        raise ProfileFileError(f"sim: profile {source}: format must be {PROFILE_FORMAT!r}, "
                               f"got {fmt!r}")
    try:
        doc = msgspec.convert(_plain(data), type=_ProfileDoc, strict=False)
    except msgspec.ValidationError as exc:
        raise ProfileFileError(f"sim: profile {source}: {_where(exc, data)}") from None
    for name, value in msgspec.structs.asdict(doc.step_time).items():
        if not math.isfinite(value):
            raise ProfileFileError(f"sim: profile {source}: step_time.{name} must be a finite "
                                   f"number, got {value}")
    for name in ("frontend_overhead_s", "idle_wakeup_s"):
        if not math.isfinite(getattr(doc, name)):
            raise ProfileFileError(f"sim: profile {source}: {name} must be a finite number")
    lora = doc.lora or _LoraCosts()
    for name, value in msgspec.structs.asdict(lora).items():
        if not math.isfinite(value):
            raise ProfileFileError(f"sim: profile {source}: lora.{name} must be a finite number")
    lim = doc.limits
    if lim.kv_cache_tokens < lim.block_size:
        raise ProfileFileError(f"sim: profile {source}: limits.kv_cache_tokens "
                               f"({lim.kv_cache_tokens}) is less than one block "
                               f"({lim.block_size} tokens)")
    if lim.max_model_len > lim.kv_cache_tokens:
        raise ProfileFileError(f"sim: profile {source}: limits.max_model_len "
                               f"({lim.max_model_len}) is larger than limits.kv_cache_tokens "
                               f"({lim.kv_cache_tokens})")
    st = doc.step_time
    return MeasuredProfile(
        name=doc.name, model=doc.model, hardware=doc.hardware,
        step_time=StepTimeModel(st.step_s, st.per_seq_s, st.per_token_s, st.per_attn_pair_s,
                                st.weights_s, st.per_kv_token_s),
        frontend_overhead_s=doc.frontend_overhead_s, vocab_size=lim.vocab_size,
        kv_cache_tokens=lim.kv_cache_tokens, max_model_len=lim.max_model_len,
        max_num_seqs=lim.max_num_seqs, max_num_batched_tokens=lim.max_num_batched_tokens,
        block_size=lim.block_size, idle_wakeup_s=doc.idle_wakeup_s, provenance=doc.provenance,
        lora_load_s=lora.load_s, lora_activate_s=lora.activate_s, lora_step_overhead_s=lora.step_s)


def load_profile_file(path: str | Path) -> MeasuredProfile:
    """Read a measured profile from a JSON or YAML file.

    Raises:
        ProfileFileError: The file is missing, cannot be parsed, or is not a valid profile.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileFileError(f"sim: profile file {path} does not exist") from None
    except OSError as exc:
        raise ProfileFileError(f"sim: cannot read profile file {path}: "
                               f"{exc.strerror or exc}") from None
    data: object
    if path.suffix.lower() in (".yaml", ".yml"):
        from ruamel.yaml import YAML
        from ruamel.yaml.error import YAMLError

        try:
            data = YAML(typ="rt").load(text)
        except YAMLError as exc:
            raise ProfileFileError(f"sim: profile file {path} is not valid YAML: "
                                   f"{_one_line(exc)}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileFileError(f"sim: profile file {path} is not valid JSON: {exc.msg} "
                                   f"(line {exc.lineno}, column {exc.colno})") from None
    return profile_from_dict(data, str(path))


def save_profile_file(profile: MeasuredProfile, path: str | Path) -> None:
    """Write a profile as JSON, or as YAML when the name ends in ``.yaml``/``.yml``."""
    path = Path(path)
    data = profile_to_dict(profile)
    if path.suffix.lower() in (".yaml", ".yml"):
        import io

        from ruamel.yaml import YAML

        yaml = YAML(typ="rt")
        yaml.default_flow_style = False
        buf = io.StringIO()
        yaml.dump(data, buf)
        text = buf.getvalue()
    else:
        text = json.dumps(data, indent=2) + "\n"
    path.write_text(text, encoding="utf-8")


def _plain(value: object) -> object:
    """ruamel's commented containers and scalars as plain Python (msgspec wants exact types)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    for kind in (int, float, str):  # ruamel's ScalarFloat, ScalarInt, ... subclasses
        if isinstance(value, kind):
            return kind(value)
    return value


def _where(exc: msgspec.ValidationError, data: Mapping[str, Any]) -> str:
    """msgspec's message with its ``$.a.b`` path as a dotted field name (and YAML line)."""
    message = str(exc)
    head, sep, path = message.rpartition(" - at `$.")
    if not sep:
        return message
    dotted = path.rstrip("`")
    line = _yaml_line(data, dotted.split("."))
    return f"{dotted}: {head}" + (f" (line {line})" if line else "")


def _yaml_line(data: Mapping[str, Any], keys: list[str]) -> int | None:
    node: Any = data
    line: int | None = None
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            break
        lc = getattr(node, "lc", None)
        if lc is not None:
            line = lc.key(key)[0] + 1
        node = node[key]
    return line


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
