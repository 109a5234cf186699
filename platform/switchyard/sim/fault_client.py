"""A client of the fault control server (``control.py``), for ``switchyard sim fault`` and ``faults``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from switchyard.sim.faults import DEFAULTS


class ControlError(Exception):
    """The control server refused the request, or could not be reached (one line saying which)."""


def _call(control: str, method: str, body: dict[str, Any] | None, timeout_s: float) -> list[dict[str, Any]]:
    if not control.startswith(("http://", "https://")):
        raise ControlError(f"the control URL must start with http:// (like http://127.0.0.1:8390), got {control!r}")
    url = control.rstrip("/") + "/faults"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method,  # noqa: S310 - http(s) checked above
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - http(s) checked above
            payload = json.load(response)
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode("utf-8", "replace").strip() or err.reason
        raise ControlError(f"the control server at {control} answered {err.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ControlError(f"cannot reach the fault control server at {control}: {reason}") from None
    except ValueError:
        payload = None
    if not isinstance(payload, dict) or not isinstance(payload.get("engines"), list):
        raise ControlError(f"{control} did not answer like a fault control server (switchyard sim --control-port)")
    engines: list[dict[str, Any]] = payload["engines"]
    return engines


def list_faults(control: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Every engine of the sim process behind ``control``, with its fault settings.

    Raises:
        ControlError: An error answer, or nothing answering at ``control``.
    """
    return _call(control, "GET", None, timeout_s)


def set_faults(control: str, body: dict[str, Any], timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Post targets and settings to ``control``; the engines they picked, as changed.

    Raises:
        ControlError: An error answer (no engine matches, a bad setting), or nothing answering.
    """
    return _call(control, "POST", body, timeout_s)


def describe(engine: dict[str, Any]) -> str:
    """One engine on one line: URL, labels, whether it listens, every fault setting."""
    faults = engine.get("faults", {})
    settings = " ".join(f"{key}={_show(faults.get(key))}" for key in DEFAULTS)
    return (f"{engine['url']} pool={engine.get('pool') or '-'} region={engine.get('region') or '-'} "
            f"listening={'yes' if engine.get('listening') else 'no'} {settings}")


def _show(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)
