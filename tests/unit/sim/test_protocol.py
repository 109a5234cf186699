"""Request parsing and vLLM's error messages."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from switchyard.sim.protocol import (
    ApiError,
    GenerationSpec,
    check_context,
    decode_body,
    parse_generation,
    plan_output,
)
from switchyard.sim.tokens import SPECIAL_TOKENS, tokenize

VOCAB = 128_256


def _chat(**body: Any) -> GenerationSpec:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_generation(body, chat=True, served_model="m", vocab_size=VOCAB)


def _completion(**body: Any) -> GenerationSpec:
    return parse_generation(body, chat=False, served_model="m", vocab_size=VOCAB)


def _error(fn: Any, **body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(**body)
    return info.value


def test_completion_prompt_forms() -> None:
    bos = SPECIAL_TOKENS["<|begin_of_text|>"]
    assert _completion(prompt="hello world").prompts == [[bos, *tokenize("hello world")]]
    assert len(_completion(prompt=["a", "b c"]).prompts) == 2
    assert _completion(prompt=[5, 6, 7]).prompts == [[5, 6, 7]]
    assert _completion(prompt=[[5, 6], [7]]).prompts == [[5, 6], [7]]


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], {"x": 1}, [[1, 2], "x"]])
def test_bad_prompts_are_400(prompt: object) -> None:
    err = _error(_completion, prompt=prompt)
    assert err.status == 400 and err.param == "prompt"


def test_out_of_vocabulary_token_is_400() -> None:
    assert "out of vocabulary" in _error(_completion, prompt=[VOCAB]).message


def test_unknown_model_is_404_in_vllms_words() -> None:
    err = _error(_chat, model="gpt-9")
    assert err.status == 404
    body = msgspec.json.decode(err.body())
    assert body == {"error": {"message": "The model `gpt-9` does not exist.",
                              "type": "NotFoundError", "param": "model", "code": 404}}


def test_missing_model_means_the_served_one() -> None:
    assert _chat().prompts


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 2}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop": 3}, "stop"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_client_mistakes_are_400(body: dict[str, Any], param: str) -> None:
    err = _error(_chat, **body)
    assert err.status == 400
    assert err.param == param
    assert err.err_type == "BadRequestError"


def test_n_other_than_one_says_why() -> None:
    assert "only n=1" in _error(_chat, n=3).message


def test_missing_messages_and_bad_json_are_400() -> None:
    with pytest.raises(ApiError, match="messages: Field required"):
        parse_generation({}, chat=True, served_model="m", vocab_size=VOCAB)
    with pytest.raises(ApiError, match="JSON decode error"):
        decode_body(b"{not json")
    with pytest.raises(ApiError, match="object"):
        decode_body(b"[1, 2]")


def test_accepted_parameters() -> None:
    spec = _chat(max_completion_tokens=9, max_tokens=3, stream=True,
                 stream_options={"include_usage": True}, temperature=0.2, top_p=0.9, seed=4,
                 stop=["\n"], priority=-3, user="u1", ignore_eos=True, min_tokens=2,
                 tools=[{"type": "function", "function": {"name": "f"}}],
                 response_format={"type": "json_object"})
    assert spec.max_tokens == 9  # max_completion_tokens wins, as in vLLM
    assert spec.stream and spec.include_usage
    assert spec.priority == -3 and spec.seed == 4


def test_context_length_errors_use_vllms_text() -> None:
    with pytest.raises(ApiError) as info:
        check_context(100, 8100, 8192)
    assert info.value.status == 400 and info.value.param == "max_tokens"
    assert "This model's maximum context length is 8192 tokens" in info.value.message
    assert "'max_tokens' or 'max_completion_tokens' is too large: 8100" in info.value.message
    with pytest.raises(ApiError, match=r"maximum context length is 8192 tokens\. However, your "
                                       r"request has 9000 input tokens"):
        check_context(9000, None, 8192)
    check_context(100, 8092, 8192)  # exactly fits


def test_output_plan() -> None:
    prompt = tokenize("tell me a story")
    exact = plan_output(_chat(max_tokens=77), prompt, 8192, 0)
    assert exact[:2] == (77, "length")
    natural = plan_output(_chat(), prompt, 8192, 0)
    assert 16 <= natural[0] <= 256 and natural[1] == "stop"
    assert plan_output(_chat(), prompt, 8192, 0) == natural  # deterministic
    assert plan_output(_chat(seed=5), prompt, 8192, 0)[2] != natural[2]
    assert plan_output(_chat(min_tokens=300), prompt, 8192, 0)[0] == 300
    capped = plan_output(_chat(), prompt, len(prompt) + 10, 0)
    assert capped == (10, "length", capped[2])
