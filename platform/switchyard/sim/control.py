"""The fault control server of a ``switchyard sim`` process (``--control-port``).

One process runs many engines; this small app, on its own port in the same event loop, sets
the faults of any of them by their labels, and is the only way back for an engine that is
``down`` (its own port is closed). Routes:

- ``GET /faults``: ``{"engines": [ENGINE, …]}``, one per engine, where ENGINE is
  ``{"url", "port", "model", "pool", "region", "listening", "faults"}`` (``pool`` and ``region``
  are null for an engine started without a policy; ``faults`` is what ``GET /sim/faults``
  answers).
- ``POST /faults``: a body of optional targets ``region`` (str), ``pool`` (str) and ``port``
  (int), matched all together (none: every engine), plus fault settings as for
  ``POST /sim/faults``. The settings go to every matching engine; the answer is
  ``{"engines": [ENGINE, …]}`` of those engines afterwards. 400 (vLLM's error shape) when no
  engine matches, naming what there is, or when a setting is invalid, and then no engine is
  changed. 500 when an engine could not listen again (its port was taken while it was down):
  it stays ``down``; the others are changed.
- ``GET /health``: 200.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State

from switchyard.sim.faults import FaultError, parse_settings
from switchyard.sim.runtime import EngineRuntime
from switchyard.sim.validation import ApiError

#: Keys of a ``POST /faults`` body that pick engines rather than set faults.
TARGETS = ("region", "pool", "port")


def engine_view(engine: EngineRuntime) -> dict[str, Any]:
    """One engine as ``/faults`` lists it."""
    cfg = engine.config
    return {"url": cfg.url, "port": cfg.port, "model": cfg.served_model, "pool": cfg.pool,
            "region": cfg.region, "listening": engine.listening, "faults": engine.faults.as_dict()}


def split_targets(body: object) -> tuple[dict[str, str | int], dict[str, Any]]:
    """Split a ``POST /faults`` body into its targets and its checked fault settings.

    Raises:
        FaultError: Not an object, a target of the wrong type, or an invalid setting.
    """
    if not isinstance(body, dict):
        raise FaultError('expected a JSON object like {"region": "eu-west", "mode": "down"}')
    targets: dict[str, str | int] = {}
    for key in TARGETS:
        value = body.get(key)
        if value is None:
            continue
        wanted_int = key == "port"
        if wanted_int and (isinstance(value, bool) or not isinstance(value, int)):
            raise FaultError(f"port must be an integer, got {value!r}")
        if not wanted_int and not isinstance(value, str):
            raise FaultError(f"{key} must be a string, got {value!r}")
        targets[key] = value
    settings = parse_settings({k: v for k, v in body.items() if k not in TARGETS})
    return targets, settings


def select(engines: Sequence[EngineRuntime], targets: dict[str, str | int]) -> list[EngineRuntime]:
    """The engines that match every target.

    Raises:
        FaultError: None matches (the message lists the regions, pools and ports there are).
    """
    chosen = [e for e in engines if all(getattr(e.config, key) == value for key, value in targets.items())]
    if not chosen:
        wanted = ", ".join(f"{k}={v}" for k, v in targets.items())

        def listed(key: str) -> str:
            return ", ".join(sorted({str(getattr(e.config, key)) for e in engines})) or "none"

        raise FaultError(f"no engine matches {wanted}; regions: {listed('region')}; pools: {listed('pool')}; "
                         f"ports: {listed('port')}")
    return chosen


def _json(data: Any, status: int = 200) -> Response[bytes]:
    return Response(msgspec.json.encode(data), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response[bytes]:
    return Response(ApiError(status, message).body(), status_code=status, media_type="application/json")


def _engines(state: State) -> list[EngineRuntime]:
    engines: list[EngineRuntime] = state["engines"]
    return engines


@get("/faults", operation_id="listFaults", sync_to_thread=False)
def list_faults(state: State) -> Response[bytes]:
    """Every engine of the process, with its fault settings."""
    return _json({"engines": [engine_view(e) for e in _engines(state)]})


@post("/faults", operation_id="setFaults", status_code=200)
async def set_faults(request: Request[Any, Any, Any], state: State) -> Response[bytes]:
    """Apply fault settings to the engines the targets pick (all of them, or none on a bad body)."""
    try:
        targets, settings = split_targets(msgspec.json.decode(await request.body()))
        chosen = select(_engines(state), targets)
    except msgspec.DecodeError as exc:
        return _error(400, f"the body is not valid JSON: {exc}")
    except FaultError as exc:
        return _error(400, str(exc))
    failed: list[str] = []
    for engine in chosen:
        engine.faults.apply(settings)
        try:
            await engine.sync_listener()
        except OSError as exc:
            failed.append(f"{engine.config.host}:{engine.config.port} ({exc.strerror or exc})")
    if failed:
        return _error(500, "could not listen again on " + ", ".join(failed) + "; it stays down")
    return _json({"engines": [engine_view(e) for e in chosen]})


@get("/health", operation_id="health", sync_to_thread=False)
def health() -> Response[bytes]:
    """200 while the control server runs."""
    return Response(b"", media_type="text/plain")


def build_control_app(engines: Sequence[EngineRuntime]) -> Litestar:
    """The control app over the engines of this process."""
    return Litestar(route_handlers=[list_faults, set_faults, health], state=State({"engines": list(engines)}),
                    openapi_config=None, logging_config=None)
