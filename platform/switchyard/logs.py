"""Logging: plain text for people, or one JSON object per line for log pipelines.

``SWITCHYARD_LOG_FORMAT=json`` makes every line (the gateway's, uvicorn's, the libraries') a JSON
object: ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message``, the
``request_id`` of the request being served when the line was written (the same id the client gets
in ``x-request-id``), ``exception`` (the traceback) when there is one, and any ``extra=`` fields.
Nothing else reaches a log line: request bodies, keys and passwords are never logged.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import traceback
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec

LogFormat = Literal["text", "json"]

#: The id of the request the current task serves (set by the gateway's request path).
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("switchyard_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Attributes every LogRecord has; anything else on a record came from ``extra=``.
#: (uvicorn's ``color_message`` repeats the message with terminal colours.)
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName",
                                                                               "color_message"}


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on each record (``record.request_id``; None outside requests)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module doc)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            out["request_id"] = request_id
        for name, value in vars(record).items():
            if name not in _STANDARD and name != "request_id" and name not in out:
                out[name] = value
        if record.exc_info:
            out["exception"] = "".join(traceback.format_exception(*record.exc_info)).rstrip()
        elif record.exc_text:
            out["exception"] = record.exc_text
        return msgspec.json.encode(out, enc_hook=str).decode()


def configure(level: str, fmt: LogFormat) -> None:
    """Send every logger's records to standard error in ``fmt`` at ``level`` (replaces earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    if fmt == "json":
        # uvicorn's own loggers keep their text handlers unless they hand records to the root's.
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            named = logging.getLogger(name)
            named.handlers.clear()
            named.propagate = True
