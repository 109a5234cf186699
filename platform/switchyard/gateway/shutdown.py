"""A gateway's shutdown, step by step: a step that takes long is named in the log.

On SIGTERM (an orchestrator stopping a replica) uvicorn gives the requests in flight their graceful period, then
the lifespans end: the batch worker hands its lines back, the usage ledger and the request log write what they
hold, the stores and the engines' connections close. Each of those steps waits on something (the database, a
thread, an engine); one still running after :data:`WARN_AFTER_S` is logged once, with its name, from a thread of
its own, so that it is said even while the event loop is blocked. An operator whose replica was killed at the end
of its grace period learns what it was waiting for.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType

log = logging.getLogger("switchyard.gateway")

#: Seconds one step of a shutdown may take before it is logged.
WARN_AFTER_S = 5.0


class ShutdownSteps:
    """The step a shutdown is in (:meth:`at`), watched from a thread while it lasts (a context manager).

    Args:
        what: What is shutting down, as the log names it.
        warn_after_s: A step still running after this long is logged (WARNING), once.
    """

    def __init__(self, what: str, warn_after_s: float = WARN_AFTER_S) -> None:
        self.what = what
        self.warn_after_s = warn_after_s
        self._step: str | None = None
        self._since = 0.0
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ShutdownSteps:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.done()

    def at(self, step: str) -> None:
        """The shutdown is now at ``step`` (the previous one ended)."""
        with self._changed:
            self._step, self._since = step, time.monotonic()
            self._changed.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="switchyard-shutdown", daemon=True)
            self._thread.start()

    def done(self) -> None:
        """The shutdown's steps are over."""
        with self._changed:
            self._step = None
            self._changed.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        warned: tuple[str, float] | None = None
        while True:
            with self._changed:
                step, since = self._step, self._since
                if step is None:
                    return
                if (step, since) == warned:
                    self._changed.wait()  # (said once: until the next step)
                    continue
                left = since + self.warn_after_s - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
            # (Logged without the lock: a slow log handler cannot hold up the next step's ``at``.)
            log.warning("%s: still %s after %.1f s", self.what, step, time.monotonic() - since)
            warned = (step, since)
