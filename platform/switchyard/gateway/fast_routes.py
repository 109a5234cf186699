"""The OpenAI-compatible POST routes answered straight from ASGI, ahead of Litestar's layers.

Every request to ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``,
``/tokenize`` and ``/detokenize`` is the gateway's hot path; Litestar's router, its CSRF and exception
middleware, its request object and the conversion of a response into ASGI messages cost about a tenth of the
gateway's CPU per request there (``switchyard bench --scenario overhead``, py-spy; the README's step table).
:class:`GatewayApp` (the app ``create_app`` makes: a Litestar app in every other respect) hands an exact POST to
one of those paths to :class:`FastRoutes`, which does what those layers did for it and nothing else:

- the body read whole, at most ``max_body_bytes`` (413 on a larger ``content-length`` before anything is
  read, or as soon as more came), a ``content-length`` that is no number a 400;
- the headers as a dict of lower-case names (the first of repeated ones, as Litestar's ``get``);
- :meth:`Proxy.serve`'s answer sent as Litestar would (its headers, then ``content-type`` and, for a whole
  answer, ``content-length``), a stream relayed chunk by chunk until it ends or the client leaves (the stream is
  then cancelled), and the answer's background task run after it (even when its write was cancelled);
- :class:`~switchyard.api.errors.ApiError` answered with OpenAI's error object, any other exception raised
  before the answer began logged and answered 500, as the app's exception handlers do.

Anything else (another method, another path, a trailing slash, the OpenAPI document that still lists these
routes) goes to Litestar, whose handlers for these paths call the same :meth:`Proxy.serve`. The CSRF check
never applied to these paths (they take API keys, not cookies), nor did the console's security headers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Litestar, Response
from litestar.enums import MediaType
from litestar.response import Stream
from litestar.utils.helpers import get_enum_string_value

from switchyard.api.errors import INTERNAL_ERROR_BODY, ApiError, error_body, http_error
from switchyard.gateway.request import Incoming, Kind, client_left
from switchyard.gateway.server import OnePieceCycle

if TYPE_CHECKING:
    from litestar.types import HTTPResponseBodyEvent, Message, Receive, Scope, Send

    from switchyard.gateway.proxy import Proxy

log = logging.getLogger("switchyard.gateway")

#: The paths answered here, and the kind of request each takes.
KINDS: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
                          "/v1/embeddings": "embedding", "/v1/responses": "responses", "/tokenize": "tokenize",
                          "/detokenize": "detokenize"}
_JSON = b"application/json"
_END: HTTPResponseBodyEvent = {"type": "http.response.body", "body": b"", "more_body": False}


class _Refused(Exception):
    """The request's body cannot be taken: answered ``status`` (``detail`` as the framework's own error)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class _Left(Exception):
    """The client went away before its body was complete."""


class FastRoutes:
    """Serves the paths of :data:`KINDS` (see the module doc).

    Args:
        proxy: Serves each request.
        max_body_bytes: The largest body taken (``Settings.max_body_bytes``, as Litestar's limit).
    """

    def __init__(self, proxy: Proxy, max_body_bytes: int) -> None:
        self.proxy = proxy
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        headers: dict[str, str] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key not in headers:
                headers[key] = value.decode("latin-1")
        try:
            raw = await self._body(receive, headers.get("content-length"))
        except _Refused as refused:
            body, extra = http_error(refused.status, refused.detail, "POST", scope["path"])
            await _send_whole(send, refused.status, body, _JSON, extra)
            return
        except _Left:
            return
        incoming = Incoming(headers, raw, functools.partial(client_left, receive))
        try:
            answer = await self.proxy.serve(incoming, kind)
        except ApiError as error:
            await _send_whole(send, error.status_code, error_body(error.message, error.type, error.code, error.param),
                              _JSON, error.headers)
            return
        except Exception:  # a bug (asyncio.CancelledError, the client gone, is not caught: nothing to answer)
            log.exception("unhandled error on POST %s", scope["path"])
            await _send_whole(send, 500, INTERNAL_ERROR_BODY, _JSON, {})
            return
        try:
            if isinstance(answer, Stream):
                await _send_stream(answer, receive, send)
            else:
                await _send_whole(send, answer.status_code or 200, _content(answer), _media_type(answer),
                                  answer.headers)
        finally:  # (also when the write was cancelled: the request's end is accounted for all the same)
            if answer.background is not None:
                await answer.background()

    async def _body(self, receive: Receive, length: str | None) -> bytes:
        limit = self.max_body_bytes
        if length is not None:
            try:
                announced = int(length)
            except ValueError:
                raise _Refused(400, f"Invalid content-length: {length!r}") from None
            if announced > limit:
                raise _Refused(413, "Request Entity Too Large")
        parts: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                if chunk:
                    total += len(chunk)
                    if total > limit:
                        raise _Refused(413, "Request Entity Too Large")
                    parts.append(chunk)
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
            elif message["type"] == "http.disconnect":
                raise _Left


def _content(answer: Response[Any]) -> bytes:
    content = answer.content
    if isinstance(content, bytes):
        return content
    return content.encode(answer.encoding) if isinstance(content, str) else msgspec.json.encode(content)


def _media_type(answer: Response[Any]) -> bytes:
    media_type = get_enum_string_value(answer.media_type or MediaType.JSON)  # (as Litestar reads it)
    if media_type.startswith("text/") and "charset=" not in media_type:
        media_type += f"; charset={answer.encoding}"
    return media_type.encode("latin-1")


def _head(status: int, headers: Mapping[str, Any], media_type: bytes, length: int | None) -> Message:
    encoded = [(name.lower().encode("latin-1"), str(value).encode("latin-1")) for name, value in headers.items()]
    if not any(name == b"content-type" for name, _ in encoded):
        encoded.append((b"content-type", media_type))
    if length is not None and not any(name == b"content-length" for name, _ in encoded):
        encoded.append((b"content-length", str(length).encode("latin-1")))
    return {"type": "http.response.start", "status": status, "headers": encoded}


def _cycle(send: Send) -> OnePieceCycle | None:
    """The gateway's server's request cycle behind ``send``, which takes an answer's head as a status and a mapping
    (``gateway.server``); None under another server (the head then goes as an ASGI message)."""
    cycle = getattr(send, "__self__", None)
    return cycle if isinstance(cycle, OnePieceCycle) else None


async def _send_whole(send: Send, status: int, body: bytes, media_type: bytes, headers: Mapping[str, Any]) -> None:
    cycle = _cycle(send)
    if cycle is not None and cycle.send_whole(status, headers, media_type, body):
        return
    await send(_head(status, headers, media_type, len(body)))
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_stream(answer: Stream, receive: Receive, send: Send) -> None:
    """Relay ``answer``'s chunks until they end, or until the client leaves (the relay is then cancelled where it
    waits, as Litestar's cancel scope did). The gateway's server says when the client leaves
    (``OnePieceCycle.on_client_gone``); under another server a task waits for ``receive``'s ``http.disconnect``."""
    status, media_type = answer.status_code or 200, _media_type(answer)
    cycle = _cycle(send)
    if cycle is None or not cycle.start_stream(status, answer.headers, media_type):
        await send(_head(status, answer.headers, media_type, None))
    relaying = asyncio.current_task()
    assert relaying is not None
    state = {"left": False, "done": False}

    def gone() -> None:
        if not state["done"]:
            state["left"] = True
            relaying.cancel()

    async def listen() -> None:
        await client_left(receive)
        gone()

    listener: asyncio.Task[None] | None = None
    if cycle is None:
        listener = asyncio.create_task(listen())
    elif cycle.disconnected:  # (gone already: the relay stops at its first wait)
        gone()
    else:
        cycle.on_client_gone = gone
    try:
        async for chunk in answer.iterator:  # type: ignore[union-attr]
            await send({"type": "http.response.body", "more_body": True,
                        "body": chunk if isinstance(chunk, bytes) else chunk.encode(answer.encoding)})
        await send(_END)
    except asyncio.CancelledError:
        if not state["left"]:
            raise
        relaying.uncancel()  # the client left: the relay stopped, the answer ends here
    finally:
        state["done"] = True
        if cycle is not None:
            cycle.on_client_gone = None
        if listener is not None:
            listener.cancel()


class GatewayApp(Litestar):
    """The whole app (``switchyard.app.create_app``): Litestar, with the hot path's routes answered by
    :class:`FastRoutes` once :meth:`serve_fast` named it (see the module doc)."""

    fast: FastRoutes | None = None

    def serve_fast(self, routes: FastRoutes) -> None:
        """Answer the paths of :data:`KINDS` with ``routes``."""
        self.fast = routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        fast = self.fast
        if fast is not None and scope["type"] == "http" and scope["method"] == "POST":
            kind = KINDS.get(scope["path"])
            if kind is not None:
                await fast(scope, receive, send, kind)
                return
        await super().__call__(scope, receive, send)
