"""Per-endpoint observations that outlive policy reloads (keyed by URL)."""

from __future__ import annotations


class EndpointLoad:
    """Requests this gateway process has in flight at each endpoint."""

    __slots__ = ("_outstanding",)

    def __init__(self) -> None:
        self._outstanding: dict[str, int] = {}

    def outstanding(self, url: str) -> int:
        """In-flight requests at ``url``."""
        return self._outstanding.get(url, 0)

    def acquire(self, url: str) -> None:
        """Count a request dispatched to ``url``."""
        self._outstanding[url] = self._outstanding.get(url, 0) + 1

    def release(self, url: str) -> None:
        """Count a request at ``url`` as finished."""
        left = self._outstanding.get(url, 0) - 1
        if left > 0:
            self._outstanding[url] = left
        else:
            self._outstanding.pop(url, None)

    def snapshot(self) -> dict[str, int]:
        """A copy of the in-flight counts, for display."""
        return dict(self._outstanding)
