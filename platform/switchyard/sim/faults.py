"""Fault injection: the ways a simulated engine can misbehave on purpose.

- ``none``: healthy.
- ``error``: a fraction (``error_rate``) of generation requests is answered 500 in vLLM's
  error shape.
- ``slow``: every engine step takes ``slow_factor`` times longer.
- ``hang``: generation requests are accepted and never get a byte back, until the mode
  changes (they then run normally) or the client leaves.
- ``down``: every endpoint but ``/sim/*`` answers 503, ``/health`` included.

A *refused connection* is not a mode: stop the process (SIGTERM) to get one.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Literal, cast

FaultMode = Literal["none", "error", "slow", "hang", "down"]
MODES: tuple[FaultMode, ...] = ("none", "error", "slow", "hang", "down")


class FaultError(ValueError):
    """A fault setting that cannot be applied (answered 400)."""


class FaultState:
    """The current fault mode of one engine.

    Args:
        seed: Seed of the error-mode coin flips (reproducible runs).
    """

    def __init__(self, seed: int = 0) -> None:
        self.mode: FaultMode = "none"
        self.error_rate = 1.0
        self.slow_factor = 5.0
        self._rng = random.Random(seed)
        self._changed = asyncio.Event()

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready data."""
        return {"mode": self.mode, "error_rate": self.error_rate, "slow_factor": self.slow_factor}

    def update(self, body: object) -> None:
        """Apply ``{"mode", "error_rate"?, "slow_factor"?}``; unspecified numbers keep theirs.

        Raises:
            FaultError: Unknown mode, or a number out of range.
        """
        if not isinstance(body, dict):
            raise FaultError('expected a JSON object like {"mode": "error", "error_rate": 0.5}')
        unknown = set(body) - {"mode", "error_rate", "slow_factor"}
        if unknown:
            raise FaultError(f"unknown fault settings: {', '.join(sorted(unknown))}")
        mode = body.get("mode", self.mode)
        if mode not in MODES:
            raise FaultError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        rate = _number(body, "error_rate", self.error_rate)
        if not 0.0 <= rate <= 1.0:
            raise FaultError(f"error_rate must be within [0, 1], got {rate}")
        factor = _number(body, "slow_factor", self.slow_factor)
        if not factor > 0.0:
            raise FaultError(f"slow_factor must be > 0, got {factor}")
        self.mode = cast(FaultMode, mode)
        self.error_rate = rate
        self.slow_factor = factor
        # Wake everything waiting in ``hang`` so it re-reads the mode.
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def step_factor(self) -> float:
        """Multiplier on step time (``slow_factor`` in slow mode, else 1)."""
        return self.slow_factor if self.mode == "slow" else 1.0

    def should_fail(self) -> bool:
        """In error mode, whether this request is one of the failing fraction."""
        return self.mode == "error" and self._rng.random() < self.error_rate

    async def wait_changed(self) -> None:
        """Return at the next settings change."""
        await self._changed.wait()


def _number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultError(f"{key} must be a number, got {value!r}")
    return float(value)
