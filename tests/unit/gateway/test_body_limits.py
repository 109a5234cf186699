"""Limits on a request body's shape: JSON nesting depth and the number of chat messages."""

from __future__ import annotations

import json

import pytest

from switchyard.api.errors import BadRequest
from switchyard.decide.admit import estimate, expected_output
from switchyard.decide.features import chat_features
from switchyard.gateway.body import MAX_CHOICES, MAX_JSON_DEPTH, check_chat, decode_json_object, nested_deeper
from switchyard.policy import compile_policy
from tests.unit.policy.base import base, to_yaml

MSG = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> bytes:
    """A chat body whose ``metadata`` nests arrays and objects so that the whole body is ``depth`` deep."""
    inner: object = 1
    for i in range(depth - 1):
        inner = [inner] if i % 2 else {"k": inner}
    return json.dumps({"model": "m", "messages": MSG, "metadata": inner}).encode()


def test_a_body_as_deep_as_the_limit_passes_one_deeper_is_400() -> None:
    assert decode_json_object(nested(MAX_JSON_DEPTH))["model"] == "m"
    with pytest.raises(BadRequest) as caught:
        decode_json_object(nested(MAX_JSON_DEPTH + 1))
    assert caught.value.code == "json_too_deep" and caught.value.status_code == 400
    assert f"more than {MAX_JSON_DEPTH} deep" in caught.value.message
    with pytest.raises(BadRequest):
        decode_json_object(nested(10), max_depth=9)
    assert decode_json_object(nested(10), max_depth=10)


@pytest.mark.parametrize("depth", [900, 5_000, 100_000])
def test_nesting_beyond_what_the_decoder_can_recurse_is_400_not_500(depth: int) -> None:
    """msgspec gives up with a RecursionError at about the interpreter's recursion limit."""
    with pytest.raises(BadRequest) as caught:
        decode_json_object(b'{"a": ' + b"[" * depth + b"]" * depth + b"}")
    assert caught.value.code == "json_too_deep"


def test_brackets_inside_strings_are_not_nesting() -> None:
    text = "[[[{{{" * 200  # far more openers than the limit, all inside a string
    body = decode_json_object(json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode())
    assert body["messages"][0]["content"] == text


def test_many_shallow_containers_are_not_deep() -> None:
    many = [{"role": "user", "content": [{"type": "text", "text": str(i)}]} for i in range(500)]
    assert len(decode_json_object(json.dumps({"model": "m", "messages": many}).encode())["messages"]) == 500


def test_nested_deeper_counts_the_value_itself_as_depth_one() -> None:
    assert not nested_deeper({}, 1) and nested_deeper({"a": []}, 1) and not nested_deeper({"a": []}, 2)
    assert nested_deeper([[[[]]]], 3) and not nested_deeper([[[[]]]], 4)
    assert not nested_deeper({"a": "[[[[", "b": [1, 2, 3]}, 2)


def test_more_messages_than_allowed_is_400_naming_messages() -> None:
    check_chat({"model": "m", "messages": MSG * 5}, max_messages=5)
    with pytest.raises(BadRequest) as caught:
        check_chat({"model": "m", "messages": MSG * 6}, max_messages=5)
    assert (caught.value.param, caught.value.code) == ("messages", "too_many_messages")
    assert "6 messages; at most 5" in caught.value.message
    check_chat({"model": "m", "messages": MSG * 2048})  # the default limit
    with pytest.raises(BadRequest):
        check_chat({"model": "m", "messages": MSG * 2049})


def test_n_is_bounded_and_admission_reserves_output_for_every_choice() -> None:

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
            "n": MAX_CHOICES + 1}
    with pytest.raises(BadRequest) as refused:
        check_chat(body)
    assert refused.value.param == "n" and refused.value.code == "invalid_value"
    body["n"] = 4
    check_chat(body)
    features = chat_features(body, {})
    assert features.choices == 4
    model = next(iter(compile_policy(to_yaml(base())).models.values()))
    one = expected_output(model, features.prompt_tokens, 50)
    assert estimate(model, features.prompt_tokens, 50, features.choices).output_tokens == 4 * one > 0
