"""An incremental parser of server-sent events (the WHATWG ``text/event-stream`` format).

No SSE client library is installed (and the ones there are wrap an HTTP client we do not use),
so this follows the specification's parsing rules directly, on bytes as they arrive:

- lines end with CRLF, LF or CR, and a CRLF split across two reads is still one line end;
- a blank line dispatches the event; an event with no ``data`` line is not dispatched;
- ``data`` lines are joined with LF; one space after the colon is dropped; a line that starts
  with a colon is a comment; a line without a colon is a field with an empty value;
- a UTF-8 byte-order mark opening the stream is dropped;
- ``event`` and ``id`` are kept (an ``id`` containing NUL is ignored); ``retry`` and unknown
  fields are ignored; bytes after the last line end wait for the next read.

Data stays ``bytes`` so JSON payloads go straight to ``msgspec`` without a decode/encode trip.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One dispatched event.

    Attributes:
        data: The event's data lines joined with ``\\n``.
        event: The event type (``message`` when the stream did not name one).
        id: The last event id seen on the stream, if any.
    """

    data: bytes
    event: str = "message"
    id: str | None = None


class SseParser:
    """Feed it the body's bytes as they arrive; it returns the events each read completes."""

    __slots__ = ("_data", "_event", "_id", "_partial", "_skip_lf", "_started")

    def __init__(self) -> None:
        self._started = False  # a byte-order mark may open the stream
        self._partial = b""  # an unterminated line
        self._skip_lf = False  # the previous read ended with CR: a leading LF is its pair
        self._data: list[bytes] = []
        self._event = ""
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Parse ``chunk``; return the events it completes, in order."""
        if not self._started and chunk:
            self._started = True
            chunk = chunk.removeprefix(b"\xef\xbb\xbf")
        if self._skip_lf and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_lf = False
        if not chunk:
            return []
        buffer = self._partial + chunk if self._partial else chunk
        if b"\r" in buffer:
            self._skip_lf = buffer.endswith(b"\r")
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buffer.split(b"\n")
        self._partial = lines.pop()
        events: list[SseEvent] = []
        for line in lines:
            if not line:
                if self._data:
                    events.append(SseEvent(b"\n".join(self._data), self._event or "message", self._id))
                self._data = []
                self._event = ""
                continue
            if line.startswith(b"data:"):  # the hot path: most lines are data lines
                value = line[5:]
                self._data.append(value[1:] if value[:1] == b" " else value)
                continue
            field, colon, value = line.partition(b":")
            if not field:  # a comment (":" first)
                continue
            if colon and value[:1] == b" ":
                value = value[1:]
            if field == b"data":
                self._data.append(value)
            elif field == b"event":
                self._event = value.decode("utf-8", "replace")
            elif field == b"id" and b"\0" not in value:
                self._id = value.decode("utf-8", "replace")
        return events

    def close(self) -> bool:
        """End of stream: discard an unfinished event, as the specification says.

        Returns:
            Whether anything was discarded (the stream was cut inside an event).
        """
        cut = bool(self._partial or self._data)
        self._partial = b""
        self._data = []
        self._event = ""
        return cut
