"""The answers of the garbage fault modes (``faults.py``): a 200 to a generation request that is no answer.

Each is a well-formed HTTP response (only ``huge`` is never finished, when its reader leaves first)
whose content is not what an OpenAI client can use. The request never reaches the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from switchyard.sim.faults import HUGE_BYTES, FaultMode
from switchyard.sim.responses import DONE, ChoiceOutput, ResponseShaper, Usage
from switchyard.simtext.tokens import VOCAB_TEXT

Send = Callable[[dict[str, Any]], Any]

_JSON = (b"content-type", b"application/json")
_SSE = (b"content-type", b"text/event-stream; charset=utf-8")
_HTML = (b"content-type", b"text/html; charset=utf-8")
#: What a proxy in front of an engine might answer in its place.
HTML_PAGE = (b"<!doctype html>\n<html><head><title>Welcome</title></head>\n"
             b"<body><h1>It works!</h1><p>This is the default page of this server.</p></body></html>\n")
#: A completion as Python prints a dict: almost JSON, and not JSON.
NOT_JSON = b"{'id': 'cmpl-garbage', 'object': 'text_completion', 'choices': [{'index': 0, 'text': 'hi'}]}"
#: Token ids of the few well-formed token events a truncated or huge stream starts with.
_TOKENS = tuple(VOCAB_TEXT)[:3]
#: Bytes per write of a huge answer.
_PIECE = 64 * 1024


async def send_garbage(send: Send, mode: FaultMode, shaper: ResponseShaper, stream: bool,
                       gone: Callable[[], bool]) -> None:
    """Answer a generation request as fault ``mode`` does (``gone``: whether the client has left)."""
    if mode == "wrong_type":
        await _whole(send, _HTML, HTML_PAGE)
    elif mode == "invalid_json":
        if stream:
            await _whole(send, _SSE, b"data: " + NOT_JSON + b"\n\n" + DONE)
        else:
            await _whole(send, _JSON, NOT_JSON)
    elif mode == "truncate":
        if stream:
            cut = shaper.token_chunks(0, _TOKENS[:1], None)
            await _whole(send, _SSE, _opening(shaper) + cut[:len(cut) // 2])
        else:
            body = shaper.full_body([ChoiceOutput(text="a whole answer, once", finish_reason="length")],
                                    Usage(prompt_tokens=4, completion_tokens=4, cached_tokens=0,
                                          created_cache_tokens=0))
            await _whole(send, _JSON, body[:len(body) // 2])
    elif mode == "huge":
        if stream:
            close = b'"}}]}\n\n' if shaper.chat else b'"}]}\n\n'
            await _huge(send, _SSE, _opening(shaper) + _open_event(shaper), close + DONE, gone)
        else:
            await _huge(send, _JSON, b'{"id":"cmpl-huge","object":"text_completion","padding":"', b'"}', gone)
    else:
        raise ValueError(f"fault mode {mode!r} is not a garbage mode")


def _opening(shaper: ResponseShaper) -> bytes:
    """A stream's first well-formed events: the role (chat) and a few tokens."""
    return (shaper.role_chunk(0) if shaper.chat else b"") + shaper.token_chunks(0, _TOKENS, None)


def _open_event(shaper: ResponseShaper) -> bytes:
    """The start of a token event whose text is left open (a huge text follows)."""
    key = b'"delta":{"content":"' if shaper.chat else b'"text":"'
    return (b'data: {"id":"' + shaper.id.encode() + b'","object":"' + shaper.object.encode()
            + b'","choices":[{"index":0,' + key)


async def _whole(send: Send, content_type: tuple[bytes, bytes], body: bytes) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [content_type, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _huge(send: Send, content_type: tuple[bytes, bytes], head: bytes, tail: bytes,
                gone: Callable[[], bool]) -> None:
    """``head``, :data:`HUGE_BYTES` of padding, ``tail``: chunked, stopping when the client leaves."""
    await send({"type": "http.response.start", "status": 200, "headers": [content_type]})
    await send({"type": "http.response.body", "body": head, "more_body": True})
    piece = b"x" * _PIECE
    for _ in range(HUGE_BYTES // _PIECE):
        if gone():
            return
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": tail, "more_body": False})
