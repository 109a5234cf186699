"""How a decision says no: the status and OpenAI error a refused request is answered with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Why flow control shed a request: above its class's threshold, a predicted wait past its deadline, or
#: the deadline passed while it waited.
ShedReason = Literal["utilisation", "predicted_wait", "deadline", "lane_full"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request that will not be served, and what its client is told.

    Attributes:
        status: The HTTP status (400, 403, 404, 429, 499, 503).
        code: The OpenAI error ``code``.
        message: The error's message.
        param: The request field it concerns, if any.
        limit: The limit that refused it (429).
        retry_after_s: When a retry may succeed (the ``Retry-After`` header), when known.
        shed: Why flow control shed it (503 from flow control).
    """

    status: int
    code: str
    message: str
    param: str | None = None
    limit: str | None = None
    retry_after_s: float | None = None
    shed: ShedReason | None = None


class Refused(Exception):
    """A decision refuses the request; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    @property
    def refusal(self) -> Refusal:
        """The refusal as the procedure answers it."""
        return Refusal(self.status, self.code, self.message, self.param)
