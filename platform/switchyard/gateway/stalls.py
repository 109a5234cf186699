"""Where the event loop was when it stalled: a diagnostic for tail latency (off by default).

The loop-lag probe (``GatewayRuntime._watch_loop_lag``) beats every 10 ms. With
``SWITCHYARD_STALL_SAMPLER_MS`` set, a watchdog thread checks that heartbeat every millisecond;
when the loop is that many milliseconds overdue, it takes the loop thread's stack
(``sys._current_frames``) once per stall and, when the loop beats again, logs one warning line::

    event loop stalled 12.4 ms at switchyard/gateway/proxy.py:212 _dispatch < aiohttp/client.py:...

The watchdog can only look when it holds the interpreter lock, so a stall inside one long Python
call is caught in that call (after at most the interpreter's switch interval), while a stall of the
whole process (not scheduled by the host, or a garbage collection, which never lets go of the lock)
is caught wherever the loop thread is when it runs again: often its poll for I/O, ``select``.
The thread itself takes a little CPU, so the bench turns it on only in a diagnostic step that it
does not count.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

log = logging.getLogger("switchyard.stalls")

#: Frames of the loop thread's stack a stall line shows (innermost first).
FRAMES = 6
#: How often the watchdog looks.
CHECK_S = 0.001
#: The line's prefix (``switchyard bench --scenario overhead`` reads it back from the gateway's log).
PREFIX = "event loop stalled"


def where(frame: object) -> str:
    """The innermost :data:`FRAMES` frames of a stack as ``path:line function < ...`` (paths from the package)."""
    parts = []
    for entry in reversed(traceback.extract_stack(frame)[-FRAMES:]):  # type: ignore[arg-type]
        path = entry.filename.replace(os.sep, "/")
        for marker in ("/site-packages/", "/platform/", "/lib/python"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
        parts.append(f"{path}:{entry.lineno} {entry.name}")
    return " < ".join(parts)


class StallSampler:
    """The watchdog (see the module doc): :meth:`beat` from the loop, :meth:`start`/:meth:`stop` around it."""

    def __init__(self, threshold_s: float, period_s: float) -> None:
        self.threshold_s = threshold_s
        self.period_s = period_s
        self.stalls = 0
        self._due = time.monotonic() + period_s
        self._loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="switchyard-stall-sampler", daemon=True)

    def beat(self) -> None:
        """The loop ran its heartbeat: the next is due one period from now (call from the loop thread)."""
        self._due = time.monotonic() + self.period_s

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)

    def _watch(self) -> None:
        sampled_for: float | None = None  # the heartbeat deadline of the stall already sampled
        stack = ""
        while not self._stop.wait(CHECK_S):
            due = self._due
            late = time.monotonic() - due
            if sampled_for is not None and due != sampled_for:  # the loop beat again: the stall is over
                self.stalls += 1
                log.warning("%s %.1f ms at %s", PREFIX, 1000 * (self._due - self.period_s - sampled_for), stack)
                sampled_for = None
            if sampled_for is None and late >= self.threshold_s:
                frame = sys._current_frames().get(self._loop_thread)
                stack = where(frame) if frame is not None else "(the loop thread is gone)"
                sampled_for = due
