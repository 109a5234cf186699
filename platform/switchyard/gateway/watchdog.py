"""The tries in flight, watched: deadlines, stalled streams and hung engines, caught off the request path.

Every try registers a :class:`Watched` entry while it is in flight (:mod:`switchyard.gateway.attempt`), and a
task looks at all of them every :data:`TICK_S`:

- **a complete (non-streamed) answer's deadline**: at its class's first-token deadline, a try whose engine has
  shown no progress since it was sent (no byte from it to any request of this process, no scrape that saw its
  progress counters move while busy) moves on (``first_token_timeout``). A streamed try's first-token deadline
  is its own timer.
- **a stalled stream**: a stream passed on to its client whose engine has sent nothing for its class's
  deadline is cut (``stalled``), and resumed on another endpoint where the policy allows.
- **a hung engine** (``resilience.hang_detection``): an engine that accepts work and makes no progress, while its
  ``/health`` stays green, is found from its own reports and this process's tries: it reported requests running
  while its progress counters did not move for ``after`` seconds (having been seen busy and moving before:
  ``EndpointState.stalled_for``); or it reported fewer requests running and waiting than this process had
  waiting there for a byte since more than ``after`` seconds before that scrape, and answered nothing since the
  first of them was sent (it does not see its intake: a hang from idle; one that answers others is only slow to
  take work in, on a starved host or a frontend tokenizing long prompts); or none of the streams this process
  has running there got a byte for ``after`` seconds; or two tries there reached their first-token deadline
  with nothing heard from the engine since they were sent. A hung engine's breaker opens at once (it comes back
  through its trial requests), its tries that have produced nothing move on (``hung``) and its streams are cut,
  to be resumed elsewhere.

The tries are aborted, never cancelled: a waiting try's ``asyncio.timeout`` is moved to now (it ends with a
:class:`TimeoutError` the try reads its reason from), a stream's upstream response is closed (its relay sees
the break). The checks read only this process's state: no I/O, a few comparisons per try.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from switchyard.engines.endpoints import EndpointRegistry
from switchyard.engines.streams import Leg, StreamRelay

log = logging.getLogger("switchyard.watchdog")

#: How often the tries in flight are looked at (seconds).
TICK_S = 0.1
#: Tries at one engine that reach their first-token deadline with nothing heard from it that make it hung.
SILENT_TIMEOUTS = 2
#: How long after a scrape its counts are compared with this process's tries (what the engine had finished
#: just before it has been answered by then).
SETTLE_S = 0.25

#: Told that an engine was found hung: (url, why).
Hung = Callable[[str, str], None]


@dataclass(slots=True, eq=False)
class Watched:
    """One try in flight, as the watchdog sees it.

    Attributes:
        url: Its endpoint.
        stream: A streamed answer.
        sent_at: When it was sent (monotonic seconds).
        deadline_s: Its class's first-token deadline (also the longest silence mid-stream).
        timer: The timeout its wait for a first byte (or a complete answer) runs under; None once it has one.
        relay: Its stream, once passed on to the client; ``leg``: its part of it.
        abort_kind, abort_reason: Why the watchdog ended its wait (None: it did not).
    """

    url: str
    stream: bool
    sent_at: float
    deadline_s: float
    timer: asyncio.Timeout | None = None
    relay: StreamRelay | None = None
    leg: Leg | None = None
    abort_kind: str | None = None
    abort_reason: str | None = None

    def abort(self, kind: str, reason: str) -> None:
        """End the try's wait now (it moves on), or cut its stream (it may be resumed)."""
        if self.relay is not None:
            if self.leg is not None and self.relay.leg is self.leg:
                self.relay.abort(reason)
            return
        timer = self.timer
        if timer is not None and self.abort_kind is None:
            self.abort_kind, self.abort_reason = kind, reason
            timer.reschedule(asyncio.get_running_loop().time())


class Watchdog:
    """Watches the tries in flight (see the module doc).

    Args:
        endpoints: The endpoint registry (what is known of each engine).
        hung: Told when an engine is found hung (after its breaker was opened).
        settings: The active policy's hang detection: (enabled, after seconds).
        urls: The active policy's endpoints.
    """

    def __init__(self, endpoints: EndpointRegistry, hung: Hung, settings: Callable[[], tuple[bool, float]],
                 urls: Callable[[], Iterable[str]]) -> None:
        self.endpoints = endpoints
        self._hung = hung
        self._settings = settings
        self._urls = urls
        self._by_url: dict[str, set[Watched]] = {}
        #: Engines found hung so far.
        self.found = 0

    def add(self, watched: Watched) -> None:
        """Watch a try from now on."""
        tries = self._by_url.get(watched.url)
        if tries is None:
            tries = self._by_url[watched.url] = set()
        tries.add(watched)

    def discard(self, watched: Watched) -> None:
        """The try ended."""
        tries = self._by_url.get(watched.url)
        if tries is not None:
            tries.discard(watched)

    def watching(self, url: str) -> int:
        """Tries in flight at ``url``."""
        return len(self._by_url.get(url, ()))

    def expired(self, watched: Watched, now: float) -> None:
        """``watched`` reached its first-token deadline: with nothing heard from its engine since it was sent, that
        is evidence of a hang (:data:`SILENT_TIMEOUTS` of them make one)."""
        state = self.endpoints.state(watched.url)
        if state.heard_at > watched.sent_at:
            return
        state.silent_timeouts += 1
        enabled, _ = self._settings()
        if enabled and state.silent_timeouts >= SILENT_TIMEOUTS:
            self._found_hung(watched.url, f"{state.silent_timeouts} requests got no first byte within their "
                                          "first-token deadline and nothing came from it since", now)

    def tick(self, now: float) -> None:
        """Look at every engine and every try in flight once (see the module doc); hung engines first, so that a
        hang is found as one even when a stream's own deadline is as short."""
        registry = self.endpoints
        for url, tries in self._by_url.items():
            bytes_at = max((w.relay.last_byte_at for w in tries if w.relay is not None and w.relay.leg is w.leg),
                           default=-math.inf)
            state = registry.state(url)
            if bytes_at > state.heard_at:
                state.heard(bytes_at)  # a stream's bytes are news of its engine too
        enabled, after = self._settings()
        if enabled:
            for url in self._urls():
                why = self._hang_of(url, now, after)
                if why is not None:
                    self._found_hung(url, why, now)
        for url, tries in list(self._by_url.items()):
            if not tries:
                del self._by_url[url]
                continue
            state = registry.state(url)
            for watched in list(tries):
                relay = watched.relay
                if relay is not None:
                    silent = now - relay.last_byte_at
                    if silent >= watched.deadline_s:
                        watched.abort("stalled", f"sent nothing for {silent:.1f} s mid-stream (the class's "
                                                 f"deadline is {watched.deadline_s:g} s)")
                elif (not watched.stream and now - watched.sent_at >= watched.deadline_s
                      and not state.alive_since(watched.sent_at) and watched.abort_kind is None):
                    watched.abort("first_token_timeout", f"its engine showed no progress within "
                                                         f"{watched.deadline_s:g} s")
                    self.expired(watched, now)

    def _hang_of(self, url: str, now: float, after: float) -> str | None:
        """Why the engine at ``url`` is hung now, or None."""
        registry = self.endpoints
        state = registry.state(url)
        if not state.healthy(now):
            return None  # already out (a hang found earlier, a failed probe, an open breaker)
        stalled = state.stalled_for(now, registry.signal_max_age)
        if stalled >= after and state.alive_at > state.hung_at:
            assert state.signals is not None
            return (f"it reported {state.signals.running:g} requests running and no progress for {stalled:.1f} s "
                    "across its /metrics")
        tries = self._by_url.get(url)
        if not tries:
            return None
        signals = state.signals
        scraped = state.scraped_at
        if signals is not None and SETTLE_S <= now - scraped <= registry.signal_max_age:
            # Tries sent well before the scrape and still without a byte now must have been in the engine's own
            # count then, running or waiting: an engine that counts fewer does not see its intake (its scheduler
            # stands still). (Tries that ended since are out of the watch: a request done in the engine just
            # before the scrape has been answered by now.)
            waiting = [w.sent_at for w in tries if w.relay is None and w.sent_at <= scraped - after]
            unstarted = len(waiting)
            reported = signals.running + signals.waiting
            # ... unless it answered something since the first of them was sent: then it is slow to take work
            # in (a starved host, a frontend still tokenizing long prompts), not stuck, and deadlines judge it.
            if unstarted > reported and not state.alive_since(min(waiting)):
                return (f"{unstarted} requests from this gateway waited there over {after:g} s without a byte while "
                        f"it reported {reported:g} running and waiting")
        streams = sum(1 for w in tries if w.relay is not None and w.relay.leg is w.leg)
        if streams and now - state.heard_at >= after:
            return (f"none of its {streams} streams from this gateway got a byte for {now - state.heard_at:.1f} s "
                    "(nor any other request)")
        return None

    def _found_hung(self, url: str, why: str, now: float) -> None:
        state = self.endpoints.state(url)
        state.hung_at = now
        state.silent_timeouts = 0
        if not state.breaker.trip(now, f"hung: {why}"):
            return
        self.found += 1
        log.warning("endpoint %s is hung: %s; taken out, and its requests move on", url, why)
        self._hung(url, why)
        for watched in list(self._by_url.get(url, ())):
            watched.abort("hung", f"its engine is hung: {why}")

    async def run(self) -> None:
        """Tick forever (cancel the task to stop)."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick(time.monotonic())
            except Exception:  # a bug here must not stop the watching of every later try
                log.exception("watchdog tick failed")
