"""Fault injection: the ways a simulated engine can misbehave on purpose.

One *mode* at a time:

- ``none``: healthy.
- ``slow``: every engine step takes ``slow_factor`` times longer.
- ``drip``: a slow drip. The scheduler makes at most one step every ``drip_interval_s`` wall-clock
  seconds, so each running stream gets about one token per interval and the ``vllm:*`` counters
  creep; ``/health`` and everything else answer as usual (an engine starved of its GPU, a worker
  thrashing on swap).
- ``hang``: the engine stalls, as a hung engine does (a stuck GPU, a deadlocked worker): its
  scheduler makes no step at all. Streams already running stop mid-answer (no more bytes); new
  requests are accepted (a stream gets its response headers, as from vLLM, whose server sends them
  before the engine's first output) and get nothing more; ``/health`` still answers 200 and
  ``/metrics`` freezes (``vllm:num_requests_running`` keeps its value, no token or request counter
  moves). A client that leaves still aborts its request (its KV blocks are freed). When the mode
  changes, the engine continues where it stopped (the tokens of a step in flight when the stall
  began come out then).
- ``down``: connection refused. The engine's listening socket is closed and its open
  connections are dropped (idle keep-alive ones too); any other mode listens again on the same
  host and port, the engine's state (KV cache, counters) kept. Once down, the engine's own port
  is gone, so only the process's control server (``switchyard sim --control-port``, driven by
  ``switchyard sim fault``) can bring it back. An app run in process, with no socket to close,
  answers 503 instead.
- ``unavailable``: every endpoint but ``/sim/*`` answers 503 in vLLM's error shape, ``/health``
  included.

A stall (``hang``, and ``drip`` between its steps) is wall-clock time the engine spends doing
nothing: when it ends, the engine's clock jumps over it (``runtime.py``), so no burst of steps
"catches up" on it, and what vLLM would measure across it (time to first token, inter-token
latency, end-to-end latency) includes it.

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
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``) while the mode is ``none``,
``slow`` or ``drip``, from one RNG seeded with the engine's seed, checked in this order:

- ``error_rate``: 500 in vLLM's error shape.
- ``throttle_rate``: 429 with ``Retry-After: 1``.
- ``overload_rate``: 503 with ``Retry-After: 1``.
- ``abort_rate``: the answer is broken off. A complete answer is cut halfway through its body and
  the connection closed. A stream gets ``abort_after_tokens`` content tokens, and then, as
  ``abort_with`` says:

  - ``close`` (the default): nothing more, neither ``data: [DONE]`` nor the end of its chunked
    body; the connection is closed (a proxy or a server process that died).
  - ``error``: the event vLLM 0.32 sends when generation fails mid-stream (its stream generators
    catch the failure, ``vllm/entrypoints/openai/*/serving.py``; ``responses.STREAM_ERROR``) in
    place of the next token, then ``data: [DONE]`` and the proper end of the response. (The
    answer then holds at most all but its last two tokens, so that the failure always shows and
    comes while the engine still runs the request.)

A rejected request (error, throttle, overload) never reaches the scheduler: it takes no
capacity and, like any request refused before the engine sees it, moves no ``vllm:*`` metric
(``/sim/state`` counts it under ``faulted``). A broken-off stream's request is aborted in the
engine as if its client had left (whichever way the stream ends); a broken-off complete answer
has finished in the engine.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping
from typing import Any, Literal

FaultMode = Literal["none", "slow", "drip", "hang", "down", "unavailable", "invalid_json", "truncate", "wrong_type",
                    "huge"]
MODES: tuple[FaultMode, ...] = ("none", "slow", "drip", "hang", "down", "unavailable", "invalid_json", "truncate",
                                "wrong_type", "huge")
#: The modes whose generation answers are garbage (see the module doc).
GARBAGE_MODES: frozenset[FaultMode] = frozenset({"invalid_json", "truncate", "wrong_type", "huge"})
#: The modes in which the rates are drawn.
DRAWING_MODES: frozenset[FaultMode] = frozenset({"none", "slow", "drip"})
#: The size of a ``huge`` answer (the gateway's default limits are 64 MiB for a body, 16 MiB for an event).
HUGE_BYTES = 80 * 1024 * 1024
#: What a draw can do to one request.
Outcome = Literal["error", "throttle", "overload", "abort"]
#: How a stream drawn by ``abort_rate`` ends.
AbortWith = Literal["close", "error"]
ABORT_WITH: tuple[AbortWith, ...] = ("close", "error")
#: The rates, in the order they are checked, and what each one does.
RATES: tuple[tuple[str, Outcome], ...] = (
    ("error_rate", "error"), ("throttle_rate", "throttle"), ("overload_rate", "overload"),
    ("abort_rate", "abort"))
#: Every setting and its default value (also what ``--clear`` goes back to).
DEFAULTS: Mapping[str, Any] = {
    "mode": "none", "slow_factor": 5.0, "drip_interval_s": 2.0, "error_rate": 0.0, "throttle_rate": 0.0,
    "overload_rate": 0.0, "abort_rate": 0.0, "abort_after_tokens": 4, "abort_with": "close"}

class FaultError(ValueError):
    """A fault setting that cannot be applied (answered 400)."""


def parse_settings(body: object) -> dict[str, Any]:
    """Check a partial settings object; return its settings with numbers normalised.

    Raises:
        FaultError: Not an object, an unknown key, an unknown mode or value, or a value out of range.
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
    for key in ("slow_factor", "drip_interval_s"):
        if key in body:
            value = _number(body, key)
            if not (value > 0.0 and math.isfinite(value)):
                raise FaultError(f"{key} must be a finite number > 0, got {value}")
            out[key] = value
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
    if "abort_with" in body:
        how = body["abort_with"]
        if how not in ABORT_WITH:
            raise FaultError(f"abort_with must be one of {', '.join(ABORT_WITH)}; got {how!r}")
        out["abort_with"] = how
    return out


class FaultState:
    """The fault settings of one engine, and the draws that apply its rates.

    Args:
        seed: Seed of the per-request draws (reproducible runs).
    """

    def __init__(self, seed: int = 0) -> None:
        self.mode: FaultMode = "none"
        self.slow_factor: float = DEFAULTS["slow_factor"]
        self.drip_interval_s: float = DEFAULTS["drip_interval_s"]
        self.error_rate = 0.0
        self.throttle_rate = 0.0
        self.overload_rate = 0.0
        self.abort_rate = 0.0
        self.abort_after_tokens: int = DEFAULTS["abort_after_tokens"]
        self.abort_with: AbortWith = DEFAULTS["abort_with"]
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
        # Wake everything waiting on a stall (the engine loop, embeddings in ``hang``) so it re-reads the mode.
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def hung(self) -> bool:
        """Whether the engine is stalled for good (mode ``hang``): no step until the mode changes."""
        return self.mode == "hang"

    @property
    def step_factor(self) -> float:
        """Multiplier on step time (``slow_factor`` in slow mode, else 1)."""
        return self.slow_factor if self.mode == "slow" else 1.0

    def draw(self) -> Outcome | None:
        """What the rates do to one inference request (None: nothing), in modes none, slow and drip.

        A rate of 0 draws no number, so setting one rate leaves the draws of another alone.
        """
        if self.mode not in DRAWING_MODES:
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
