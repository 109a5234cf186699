"""What the ``failover`` scenario reads of the gateway while the load runs, through its admin API (the bench
gives the gateway an admin token): the failing region's endpoints going out of service and back
(``GET /admin/api/endpoints``, every :data:`POLL_S`), and the request log (``GET /admin/api/requests``, the
last 500 requests, every :data:`RECORDS_EVERY_S`: at this load that is under half of what it holds)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import aiohttp

from switchyard.bench.scenarios.failover.timeline import EndpointChange, Timeline

#: Seconds between two reads of the endpoints' state (a detection is seen at most this late).
POLL_S = 0.1
#: Seconds between two reads of the request log.
RECORDS_EVERY_S = 5.0
RECORDS_LIMIT = 500
TIMEOUT_S = 2.0
#: What a request log record keeps here (its decision trace only when it failed).
RECORD_FIELDS = ("time", "request_id", "model", "region", "endpoint", "status", "outcome", "error_code", "stream",
                 "attempts", "moved_on", "resumes", "hedges", "ttft_ms", "duration_ms", "completion_tokens",
                 "max_tokens")


def record_at(record: dict[str, Any], wall_start: float) -> float | None:
    """When a request log record's request arrived, on the load's clock (None: no readable time)."""
    try:
        return datetime.fromisoformat(str(record["time"]).replace("Z", "+00:00")).timestamp() - wall_start
    except (KeyError, ValueError):
        return None


class GatewayWatch:
    """Polls the gateway's admin API into ``line`` (``changes``, ``records``) until cancelled.

    Args:
        base_url: The gateway.
        token: Its admin token.
        home_urls: The endpoints of the region that fails.
        line: Where what is seen goes.
    """

    def __init__(self, base_url: str, token: str, home_urls: Sequence[str], line: Timeline) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.home_urls = list(home_urls)
        self.line = line
        #: Each home endpoint's last state seen (True: in service).
        self.state: dict[str, bool] = {}
        self.errors = 0

    async def _get(self, session: aiohttp.ClientSession, path: str) -> dict[str, Any] | None:
        try:
            async with session.get(f"{self.base_url}{path}", headers=self.headers,
                                   timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as response:
                if response.status != 200:
                    self.errors += 1
                    return None
                body: dict[str, Any] = await response.json()
                return body
        except (TimeoutError, aiohttp.ClientError, ValueError):
            self.errors += 1
            return None

    async def poll_endpoints(self, session: aiohttp.ClientSession, now: Callable[[], float]) -> None:
        """Read the endpoints once; note every home endpoint whose service state changed."""
        body = await self._get(session, "/admin/api/endpoints")
        if body is None:
            return
        at = now()
        for row in body.get("endpoints", []):
            url = row.get("url")
            if url not in self.home_urls:
                continue
            in_service = bool(row.get("healthy"))
            if self.state.get(url) == in_service:
                continue
            self.state[url] = in_service
            breaker = row.get("breaker") or {}
            state = str(breaker.get("state", "-"))
            reason = f"breaker {state}: {breaker.get('last_reason')}" if state != "closed" else \
                f"health: {row.get('failure')}" if row.get("failure") else None
            self.line.changes.append(EndpointChange(at, url, in_service, state, reason))

    async def poll_records(self, session: aiohttp.ClientSession) -> None:
        """Read the request log once; keep the records not seen yet."""
        body = await self._get(session, f"/admin/api/requests?limit={RECORDS_LIMIT}")
        if body is None:
            return
        for record in body.get("requests", []):
            rid = record.get("request_id")
            if rid is None or rid in self.line.records:
                continue
            kept = {k: record.get(k) for k in RECORD_FIELDS}
            if record.get("outcome") != "ok":
                kept["trace"] = record.get("trace")
            self.line.records[str(rid)] = kept

    def all_in_service(self) -> bool:
        """Whether the gateway had every home endpoint in service at the last read."""
        return len(self.state) == len(self.home_urls) and all(self.state.values())

    async def run(self, session: aiohttp.ClientSession, now: Callable[[], float]) -> None:
        """Poll until cancelled (the endpoints every :data:`POLL_S`, the request log every
        :data:`RECORDS_EVERY_S`)."""
        loop = asyncio.get_running_loop()
        next_records = loop.time() + RECORDS_EVERY_S
        while True:
            due = loop.time() + POLL_S
            await self.poll_endpoints(session, now)
            if loop.time() >= next_records:
                next_records = loop.time() + RECORDS_EVERY_S
                await self.poll_records(session)
            await asyncio.sleep(max(0.0, due - loop.time()))

    async def wait_back(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) until the gateway has every home endpoint in service again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.all_in_service():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(POLL_S / 2)
        return True


async def stop(task: asyncio.Task[None] | None) -> None:
    """Cancel a :meth:`GatewayWatch.run` task and wait for it."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
