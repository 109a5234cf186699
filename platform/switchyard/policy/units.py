"""Units of the policy document: durations written as seconds or with a unit (``"10m"``)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def _parse_duration(value: Any) -> float:
    """Accept ``90``, ``"90s"``, ``"10m"``, ``"1h"``, ``"1d"``, ``"250ms"``; return seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or a string like '10m'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"invalid duration {value!r}: use seconds or a string like '30s', '10m', '1h', '1d'")
    if seconds <= 0:
        raise ValueError("a duration must be > 0")
    return seconds


Duration = Annotated[
    float,
    BeforeValidator(_parse_duration),
    WithJsonSchema({
        "anyOf": [{"type": "number", "exclusiveMinimum": 0},
                  {"type": "string", "pattern": _DURATION.pattern}],
        "description": "Seconds, or a number with a unit: ms, s, m, h, d (e.g. '10m').",
    }),
]
