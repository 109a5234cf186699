"""The SSE parser, on the specification's edge cases and on arbitrary read boundaries."""

from __future__ import annotations

import pytest

from switchyard.bench.sse import SseEvent, SseParser

STREAM = (
    b": a comment\n"
    b"data: {\"a\": 1}\n\n"
    b"event: ping\n"
    b"id: 7\n"
    b"data: first\n"
    b"data:second\n"
    b"\n"
    b"retry: 100\n"
    b"data\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SseEvent(b'{"a": 1}'),
    SseEvent(b"first\nsecond", "ping", "7"),
    SseEvent(b"", "message", "7"),
    SseEvent(b"[DONE]", "message", "7"),
]


def _parse(chunks: list[bytes]) -> list[SseEvent]:
    parser = SseParser()
    return [e for c in chunks for e in parser.feed(c)]


def test_whole_stream() -> None:
    assert _parse([STREAM]) == EXPECTED


@pytest.mark.parametrize("ending", [b"\r\n", b"\r"])
def test_other_line_endings(ending: bytes) -> None:
    assert _parse([STREAM.replace(b"\n", ending)]) == EXPECTED


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_every_split_point(ending: bytes) -> None:
    stream = STREAM.replace(b"\n", ending)
    for cut in range(len(stream) + 1):
        assert _parse([stream[:cut], stream[cut:]]) == EXPECTED, cut
    assert _parse([bytes([b]) for b in stream]) == EXPECTED


def test_crlf_split_across_reads_is_one_line_end() -> None:
    parser = SseParser()
    assert parser.feed(b"data: x\r") == []
    assert parser.feed(b"\n\r") == [SseEvent(b"x")]
    assert parser.feed(b"\ndata: y\r\n\r\n") == [SseEvent(b"y")]


def test_unfinished_event_is_dropped_and_reported() -> None:
    parser = SseParser()
    assert parser.feed(b"data: whole\n\ndata: cut") == [SseEvent(b"whole")]
    assert parser.close() is True
    clean = SseParser()
    clean.feed(b"data: whole\n\n")
    assert clean.close() is False


def test_bom_and_event_without_data() -> None:
    assert _parse([b"\xef\xbb\xbfdata: a\n\nevent: nothing\n\n"]) == [SseEvent(b"a")]
