"""The engines' clients, and what their failures mean.

Requests to engines (completions, streams, adapter loads) go through :class:`~switchyard.engines.http1.EngineClient`,
HTTP/1.1 over httptools made for that one job (its module doc says why); the gateway's other calls to engines
(health probes, metrics scrapes, the embedding classifiers) use an aiohttp session (:func:`create_client_session`).
A streamed answer is read and relayed by :mod:`switchyard.engines.streams`; the readers here take an answer of
either client.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import yarl

from switchyard.engines.http1 import KEEPALIVE_S, AnswerBroken, EngineClient, EngineConnectError, EngineResponse

# Error texts from an engine are shown to clients; never forward more than this of them.
MAX_ERROR_BODY = 16_384
#: The default of ``Settings.upstream_max_response_bytes``: the largest complete answer the gateway
#: reads from an engine.
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
#: An engine's answer, from either client.
Answer = EngineResponse | aiohttp.ClientResponse
#: What reading an answer raises when its connection broke (either client's).
BROKEN = (AnswerBroken, aiohttp.ClientError)


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """How long to wait to connect, and for each read from an engine."""

    connect_s: float
    read_s: float


def create_client_session(timeouts: UpstreamTimeouts, max_connections: int) -> aiohttp.ClientSession:
    """The process-wide aiohttp client for the calls to engines off the request path (create it inside the app's
    lifespan)."""
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, ttl_dns_cache=300,
                                     keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None, connect=timeouts.connect_s, sock_read=timeouts.read_s)
    # No cookie jar: a cookie one engine set would go with every later request to that host.
    return aiohttp.ClientSession(connector=connector, timeout=timeout, raise_for_status=False,
                                 auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())


def create_engine_client(timeouts: UpstreamTimeouts, max_connections: int) -> EngineClient:
    """The process-wide client of requests to engines (inside the app's lifespan: it needs the running loop)."""
    return EngineClient(connect_s=timeouts.connect_s, read_s=timeouts.read_s, max_connections=max_connections,
                        user_agent=USER_AGENT)


#: The User-Agent of the gateway's requests to engines.
USER_AGENT = "switchyard"


@functools.lru_cache(maxsize=4096)
def engine_url(base: str, path: str) -> yarl.URL:
    """``base`` + ``path`` parsed once (aiohttp parses a URL given as text on every request)."""
    return yarl.URL(base + path)


class UpstreamFailure(Exception):
    """The engine could not be reached, did not answer in time, or answered something that is no answer.

    ``refused``: no connection could be made at all (the engine is gone, not just slow or broken).
    ``invalid``: the engine answered 200 with garbage: not JSON, the wrong content type, too large, or a
    stream that is not SSE.
    """

    def __init__(self, message: str, *, timeout: bool, refused: bool = False, invalid: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout
        self.refused = refused
        self.invalid = invalid

    @property
    def kind(self) -> str:
        """``connect_error``, ``timeout``, ``invalid_response`` or ``broken`` (a connection that broke off)."""
        return ("timeout" if self.timeout else "connect_error" if self.refused else
                "invalid_response" if self.invalid else "broken")


def invalid(url: object, what: str) -> UpstreamFailure:
    """The failure of an engine at ``url`` that answered garbage (``what`` says which)."""
    return UpstreamFailure(f"{url} answered {what}", timeout=False, invalid=True)


@dataclass(frozen=True, slots=True)
class EngineError:
    """A non-2xx answer from an engine: its status, message, and the engine's own code."""

    status: int
    message: str
    type: str | None
    code: str | int | None
    param: str | None
    retry_after: str | None


async def post(client: EngineClient, url: yarl.URL, payload: bytes, headers: Mapping[str, str]) -> EngineResponse:
    """POST to an engine (:class:`~switchyard.engines.http1.EngineClient`); the answer once its head came.
    Connection failures and timeouts become :class:`UpstreamFailure`.

    A kept-alive connection the engine closed before any answer came is tried once more, at once, on a new
    connection (the client's own rule); an engine that is really gone closes or refuses that one too. Redirects
    are never followed: the gateway connects only to the endpoints of its policy, so an engine's 3xx is answered
    like any other error status (the caller's to judge).
    """
    try:
        return await client.post(url, payload, headers)
    except TimeoutError:
        raise UpstreamFailure(f"{url} did not answer in time", timeout=True) from None
    except EngineConnectError as exc:
        raise UpstreamFailure(f"cannot connect to {url}: {exc.strerror or exc}", timeout=False, refused=True) from None
    except (AnswerBroken, ValueError) as exc:
        raise UpstreamFailure(f"{url}: {exc}", timeout=False) from None


async def read_body(response: Answer, max_bytes: int = MAX_RESPONSE_BYTES) -> bytes:
    """The whole body of a non-streaming 2xx answer: a JSON object of at most ``max_bytes`` (see
    :func:`read_answer`, which also gives its ``usage``)."""
    data, _ = await read_answer(response, max_bytes)
    return data


async def read_answer(response: Answer,
                      max_bytes: int = MAX_RESPONSE_BYTES) -> tuple[bytes, dict[str, Any] | None]:
    """The whole body of a non-streaming 2xx answer, a JSON object of at most ``max_bytes``, and its
    ``usage`` object (None when it has none): the body is decoded once, for both.

    Raises:
        UpstreamFailure: The answer broke off or stopped (timeout); or (``invalid``) it is not
            ``application/json``, is larger than ``max_bytes`` (the rest is never read: the connection is
            closed), or is not a JSON object.
    """
    ok = False
    try:
        if response.content_type != "application/json":
            raise invalid(response.url, f"{response.status} with content type {response.content_type!r}, "
                                        "not application/json")
        if response.content_length is not None and response.content_length > max_bytes:
            raise invalid(response.url, f"{response.content_length} bytes, more than the gateway's limit "
                                        f"of {max_bytes} (upstream_max_response_bytes)")
        parts: list[bytes] = []
        size = 0
        while chunk := await response.content.readany():
            size += len(chunk)
            if size > max_bytes:
                raise invalid(response.url, f"more than the gateway's limit of {max_bytes} bytes "
                                            "(upstream_max_response_bytes)")
            parts.append(chunk)
        data = b"".join(parts)
        usage = check_json_object(response.url, data)
        ok = True
        return data, usage
    except TimeoutError:
        raise UpstreamFailure(f"{response.url} stopped answering mid-response", timeout=True) from None
    except BROKEN as exc:
        raise UpstreamFailure(f"{response.url} broke off its answer: {exc}", timeout=False) from None
    finally:
        if ok:
            response.release()
        else:
            response.close()  # what is left unread must not stay on a pooled connection


def check_json_object(url: object, data: bytes) -> dict[str, Any] | None:
    """Check that ``data`` is one JSON object (its members are not looked at beyond their syntax); its
    ``usage`` object, if it has one.

    Raises:
        UpstreamFailure: (``invalid``) It is not.
    """
    try:
        usage = msgspec.json.decode(data, type=_UsageOnly).usage
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise invalid(url, f"200 with a body that is not a JSON object ({exc})") from None
    return usage if isinstance(usage, dict) else None


async def read_engine_error(response: Answer) -> EngineError:
    """Read a non-2xx answer in either of vLLM's error shapes (or plain text)."""
    try:
        raw = await response.content.read(MAX_ERROR_BODY)
    except (*BROKEN, TimeoutError):
        raw = b""
    finally:
        response.close()
    message, type_, code, param = raw.decode("utf-8", "replace").strip() or response.reason or "", None, None, None
    try:
        data = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, dict):
        inner: dict[str, Any] = data["error"] if isinstance(data.get("error"), dict) else data
        if isinstance(inner.get("message"), str):
            message = inner["message"]
        type_ = inner.get("type") if isinstance(inner.get("type"), str) else None
        code = inner.get("code") if isinstance(inner.get("code"), str | int) else None
        param = inner.get("param") if isinstance(inner.get("param"), str) else None
    return EngineError(response.status, message, type_, code, param, response.headers.get("Retry-After"))


def _count(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


class _UsageOnly(msgspec.Struct):
    """Decodes only the ``usage`` field of an answer (the rest is skipped, not built)."""

    usage: Any = None


def usage_counts(usage: Mapping[str, Any], prompt: int, completion: int) -> tuple[int, int, int]:
    """Prompt, completion and cached prompt tokens of an engine's ``usage`` object (the given
    prompt and completion where it lacks them; an embedding's has no completion tokens; the Responses
    API's says ``input_tokens`` and ``output_tokens``)."""
    if "input_tokens" in usage:  # the Responses API's names
        details = usage.get("input_tokens_details")
        return (_count(usage.get("input_tokens"), prompt), _count(usage.get("output_tokens"), completion),
                _count(details.get("cached_tokens"), 0) if isinstance(details, dict) else 0)
    details = usage.get("prompt_tokens_details")
    return (_count(usage.get("prompt_tokens"), prompt), _count(usage.get("completion_tokens"), completion),
            _count(details.get("cached_tokens"), 0) if isinstance(details, dict) else 0)
