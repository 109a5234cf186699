"""Request-body checks: what the gateway relies on, each failure a 400 naming its parameter."""

from __future__ import annotations

import pytest

from switchyard.api.errors import BadRequest
from switchyard.gateway.body import check_chat, check_completion, decode_json_object

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("raw", "message"), [
    (b"", "empty"), (b"{", "could not parse"), (b"[]", "must be a JSON object"), (b'"x"', "must be a JSON object"),
])
def test_decode(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        decode_json_object(raw)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MSG}, "model"),
    ({"model": "", "messages": MSG}, "model"),
    ({"model": 3, "messages": MSG}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": ["hi"]}, "messages[0]"),
    ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"model": "m", "messages": MSG, "max_completion_tokens": "9"}, "max_completion_tokens"),
    ({"model": "m", "messages": MSG, "n": 0}, "n"),
    ({"model": "m", "messages": MSG, "stream": 1}, "stream"),
    ({"model": "m", "messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "messages": MSG, "stream": True, "stream_options": []}, "stream_options"),
    ({"model": "m", "messages": MSG, "tools": {}}, "tools"),
])
def test_chat_errors_name_the_parameter(body: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        check_chat(body)
    assert caught.value.param == param


def test_valid_chat_bodies() -> None:
    check_chat({"model": "m", "messages": MSG})
    check_chat({"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": []}],
                "stream": True, "stream_options": {"include_usage": True}, "max_tokens": None})
    check_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})


@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_valid_prompts(prompt: object) -> None:
    check_completion({"model": "m", "prompt": prompt})


@pytest.mark.parametrize("prompt", [None, 3, [], ["a", 1], [True], [[]], [[1, "x"]]])
def test_invalid_prompts(prompt: object) -> None:
    with pytest.raises(BadRequest) as caught:
        check_completion({"model": "m", "prompt": prompt})
    assert caught.value.param == "prompt"
