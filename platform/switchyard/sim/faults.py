"""Fault injection: the ways a simulated engine can misbehave on purpose.

One *mode* at a time:

- ``none``: healthy.
- ``slow``: every engine step takes ``slow_factor`` times longer.
- ``hang``: inference requests are accepted and never get a byte back, until the mode
  changes (they then run normally) or the client leaves.
- ``down``: connection refused. The engine's listening socket is closed and its open
  connections are dropped (idle keep-alive ones too); any other mode listens again on the same
  host and port, the engine's state (KV cache, counters) kept. Once down, the engine's own port
  is gone, so only the process's control server (``switchyard sim --control-port``, driven by
  ``switchyard sim fault``) can bring it back. An app run in process, with no socket to close,
  answers 503 instead.
- ``unavailable``: every endpoint but ``/sim/*`` answers 503 in vLLM's error shape, ``/health``
  included.

And the *garbage* modes: generation requests (``/v1/completions``, ``/v1/chat/completions``) are
answered 200 with something that is no answer, as a broken engine or a misconfigured proxy in front
of one could (``garbage.py``); ``/health`` and every other route stay fine, and no request reaches
the scheduler:

- ``invalid_json``: a body that is not JSON (a stream: a first event whose data is not JSON).
- ``truncate``: a complete HTTP answer whose content is cut short: a JSON body cut halfway (its
  ``Content-Length`` that of the cut body); a stream of a few token events that ends inside an
  event, without ``data: [DONE]``.
- ``wrong_type``: an HTML page (``text/html``), streamed or not.
- ``huge``: an answer of :data:`HUGE_BYTES` (more than the gateway reads): a JSON object sent
  without ``Content-Length``; a stream of a few token events and then one event that large.

And independent *rates*, each in [0, 1] (default 0), drawn per inference request
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``) while the mode is ``none``
or ``slow``, from one RNG seeded with the engine's seed, checked in this order:

- ``error_rate``: 500 in vLLM's error shape.
- ``throttle_rate``: 429 with ``Retry-After: 1``.
- ``overload_rate``: 503 with ``Retry-After: 1``.
- ``abort_rate``: the answer is broken off. A stream is cut after ``abort_after_tokens``
  content tokens, with neither ``data: [DONE]`` nor the end of its chunked body; a complete
  answer is cut halfway through its body. Either way the connection is then closed.

A rejected request (error, throttle, overload) never reaches the scheduler: it takes no
capacity and, like any request refused before the engine sees it, moves no ``vllm:*`` metric
(``/sim/state`` counts it under ``faulted``). A broken-off stream's request is aborted in the
engine as if its client had left; a broken-off complete answer has finished in the engine.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping
from typing import Any, Literal

FaultMode = Literal["none", "slow", "hang", "down", "unavailable", "invalid_json", "truncate", "wrong_type", "huge"]
MODES: tuple[FaultMode, ...] = ("none", "slow", "hang", "down", "unavailable", "invalid_json", "truncate",
                                "wrong_type", "huge")
#: The modes whose generation answers are garbage (see the module doc).
GARBAGE_MODES: frozenset[FaultMode] = frozenset({"invalid_json", "truncate", "wrong_type", "huge"})
#: The size of a ``huge`` answer (the gateway's default limits are 64 MiB for a body, 16 MiB for an event).
HUGE_BYTES = 80 * 1024 * 1024
#: What a draw can do to one request.
Outcome = Literal["error", "throttle", "overload", "abort"]
#: The rates, in the order they are checked, and what each one does.
RATES: tuple[tuple[str, Outcome], ...] = (
    ("error_rate", "error"), ("throttle_rate", "throttle"), ("overload_rate", "overload"),
    ("abort_rate", "abort"))
#: Every setting and its default value (also what ``--clear`` goes back to).
DEFAULTS: Mapping[str, Any] = {
    "mode": "none", "slow_factor": 5.0, "error_rate": 0.0, "throttle_rate": 0.0,
    "overload_rate": 0.0, "abort_rate": 0.0, "abort_after_tokens": 4}


class FaultError(ValueError):
    """A fault setting that cannot be applied (answered 400)."""


def parse_settings(body: object) -> dict[str, Any]:
    """Check a partial settings object; return its settings with numbers normalised.

    Raises:
        FaultError: Not an object, an unknown key, an unknown mode or a value out of range.
    """
    if not isinstance(body, dict):
        raise FaultError('expected a JSON object like {"mode": "slow", "error_rate": 0.5}')
    unknown = sorted(set(body) - set(DEFAULTS))
    if unknown:
        raise FaultError(f"unknown fault settings: {', '.join(map(str, unknown))} "
                         f"(valid: {', '.join(DEFAULTS)})")
    out: dict[str, Any] = {}
    if "mode" in body:
        mode = body["mode"]
        if mode not in MODES:
            hint = " (the 'error' mode is gone: set error_rate instead)" if mode == "error" else ""
            raise FaultError(f"mode must be one of {', '.join(MODES)}; got {mode!r}{hint}")
        out["mode"] = mode
    if "slow_factor" in body:
        factor = _number(body, "slow_factor")
        if not (factor > 0.0 and math.isfinite(factor)):
            raise FaultError(f"slow_factor must be a finite number > 0, got {factor}")
        out["slow_factor"] = factor
    for key, _ in RATES:
        if key in body:
            rate = _number(body, key)
            if not 0.0 <= rate <= 1.0:
                raise FaultError(f"{key} must be within [0, 1], got {rate}")
            out[key] = rate
    if "abort_after_tokens" in body:
        tokens = body["abort_after_tokens"]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise FaultError(f"abort_after_tokens must be an integer >= 0, got {tokens!r}")
        out["abort_after_tokens"] = tokens
    return out


class FaultState:
    """The fault settings of one engine, and the draws that apply its rates.

    Args:
        seed: Seed of the per-request draws (reproducible runs).
    """

    def __init__(self, seed: int = 0) -> None:
        self.mode: FaultMode = "none"
        self.slow_factor: float = DEFAULTS["slow_factor"]
        self.error_rate = 0.0
        self.throttle_rate = 0.0
        self.overload_rate = 0.0
        self.abort_rate = 0.0
        self.abort_after_tokens: int = DEFAULTS["abort_after_tokens"]
        #: Requests each outcome has hit so far (for ``/sim/state``).
        self.counts: dict[Outcome, int] = {outcome: 0 for _, outcome in RATES}
        self._rng = random.Random(seed)
        self._changed = asyncio.Event()

    def as_dict(self) -> dict[str, Any]:
        """Every setting as JSON-ready data."""
        return {key: getattr(self, key) for key in DEFAULTS}

    def update(self, body: object) -> None:
        """Check and apply a partial settings object; settings left out keep their value.

        Raises:
            FaultError: The body is invalid (nothing is changed then).
        """
        self.apply(parse_settings(body))

    def apply(self, settings: Mapping[str, Any]) -> None:
        """Apply settings already checked by ``parse_settings``."""
        for key, value in settings.items():
            setattr(self, key, value)
        # Wake everything waiting in ``hang`` so it re-reads the mode.
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def step_factor(self) -> float:
        """Multiplier on step time (``slow_factor`` in slow mode, else 1)."""
        return self.slow_factor if self.mode == "slow" else 1.0

    def draw(self) -> Outcome | None:
        """What the rates do to one inference request (None: nothing), in modes none and slow.

        A rate of 0 draws no number, so setting one rate leaves the draws of another alone.
        """
        if self.mode not in ("none", "slow"):
            return None
        for key, outcome in RATES:
            rate: float = getattr(self, key)
            if rate > 0.0 and self._rng.random() < rate:
                self.counts[outcome] += 1
                return outcome
        return None

    async def wait_changed(self) -> None:
        """Return at the next settings change."""
        await self._changed.wait()


def _number(body: dict[str, Any], key: str) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FaultError(f"{key} must be a number, got {value!r}")
    return float(value)
