"""Request parsing and vLLM 0.32's error answers (status, type, param and message)."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from switchyard.sim.protocol import (
    ApiError,
    GenerationSpec,
    check_context,
    decode_body,
    find_stop,
    parse_generation,
    plan_output,
)
from switchyard.simtext.tokens import SPECIAL_TOKENS, VOCAB_TEXT, filler_ids, tokenize

VOCAB = 128_256
CONTEXT = 8192


def _chat(**body: Any) -> GenerationSpec:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_generation(body, chat=True, served_model="m", vocab_size=VOCAB, max_model_len=CONTEXT)


def _completion(**body: Any) -> GenerationSpec:
    return parse_generation(body, chat=False, served_model="m", vocab_size=VOCAB, max_model_len=CONTEXT)


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


@pytest.mark.parametrize(("prompt", "param", "err_type"), [
    ([], None, "BadRequestError"),
    ([[]], None, "BadRequestError"),
    ("", "prompt", "BadRequestError"),
    (None, "prompt", "BadRequestError"),
    ([1, "a"], "body.prompt.1", "Bad Request"),
    ([1, 2.5], "body.prompt.1", "Bad Request"),
    ({"x": 1}, "body.prompt", "Bad Request"),
    ([[1, 2], "x"], "body.prompt.0", "Bad Request"),
])
def test_bad_prompts_are_400(prompt: object, param: str | None, err_type: str) -> None:
    err = _error(_completion, prompt=prompt)
    assert (err.status, err.param, err.err_type) == (400, param, err_type)


def test_prompt_fields_are_read_leniently_as_pydantic_does() -> None:
    assert _completion(prompt=[5, "6", 7.0]).prompts == [[5, 6, 7]]
    spec = _completion(prompt="x", max_tokens="3", stream="true", n=True, temperature="0.5")
    assert (spec.max_tokens, spec.stream, spec.n) == (3, True, 1)


def test_out_of_vocabulary_token_is_400() -> None:
    err = _error(_completion, prompt=[VOCAB])
    assert err.message == f"Token id {VOCAB} is out of vocabulary" and err.param is None


def test_unknown_model_is_404_in_vllms_words() -> None:
    err = _error(_chat, model="gpt-9")
    assert err.status == 404
    body = msgspec.json.decode(err.body())
    assert body == {"error": {"message": "The model `gpt-9` does not exist. Valid aliases: m.",
                              "type": "NotFoundError", "param": "model", "code": 404}}


def test_missing_model_means_the_served_one() -> None:
    assert _chat().prompts


@pytest.mark.parametrize(("body", "param", "err_type"), [
    ({"n": 0}, None, "BadRequestError"),
    ({"max_tokens": 0}, "max_tokens", "BadRequestError"),
    ({"max_tokens": -1}, "max_tokens", "BadRequestError"),
    ({"max_tokens": "ten"}, "body.max_tokens", "Bad Request"),
    ({"max_tokens": 2.5}, "body.max_tokens", "Bad Request"),
    ({"min_tokens": 5, "max_tokens": 2}, None, "BadRequestError"),
    ({"min_tokens": -1}, None, "BadRequestError"),
    ({"temperature": -1}, "temperature", "BadRequestError"),
    ({"temperature": 2.5}, "temperature", "BadRequestError"),
    ({"top_p": 1.5}, "top_p", "BadRequestError"),
    ({"top_p": 0}, "top_p", "BadRequestError"),
    ({"stop": 3}, "body.stop", "Bad Request"),
    ({"stop": ["a", 1]}, "body.stop", "Bad Request"),
    ({"stream": "sometimes"}, "body.stream", "Bad Request"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "BadRequestError"),
    ({"stream": True, "stream_options": 5}, "body.stream_options", "Bad Request"),
    ({"user": 5}, "body.user", "Bad Request"),
    ({"model": 5}, "body.model", "Bad Request"),
    ({"messages": [{"content": "no role"}]},
     "body.messages.0.ChatCompletionDeveloperMessageParam.role", "Bad Request"),
    ({"messages": [{"role": 1}]}, "body.messages.0.ChatCompletionDeveloperMessageParam.content", "Bad Request"),
    ({"messages": [{"role": "user", "content": 5}]},
     "body.messages.0.ChatCompletionDeveloperMessageParam.content", "Bad Request"),
    ({"messages": ["hi"]}, "body.messages.0.ChatCompletionDeveloperMessageParam", "Bad Request"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, None, "BadRequestError"),
    ({"messages": "hi"}, "body.messages", "Bad Request"),
    ({"messages": []}, None, "BadRequestError"),
    ({"cache_salt": ""}, "cache_salt", "BadRequestError"),
    ({"cache_salt": 5}, "cache_salt", "BadRequestError"),
    ({"top_logprobs": 2}, "top_logprobs", "BadRequestError"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "BadRequestError"),
])
def test_client_mistakes_are_400(body: dict[str, Any], param: str | None, err_type: str) -> None:
    err = _error(_chat, **body)
    assert (err.status, err.param, err.err_type) == (400, param, err_type)


def test_checks_run_in_vllms_order() -> None:
    # Field types first, then the model, then sampling parameters in SamplingParams' order.
    assert _error(_chat, model="nope", max_tokens="x").param == "body.max_tokens"
    assert _error(_chat, model="nope", temperature=5).status == 404
    assert _error(_chat, max_tokens=-1, temperature=5).param == "temperature"
    assert _error(_chat, n=0, temperature=5).message == "n must be at least 1, got 0."
    assert _error(_completion, prompt=[1] * 9000, max_tokens=9000).param == "max_tokens"


def test_n_samples_each_prompt() -> None:
    assert _chat(n=3).n == 3
    assert _completion(prompt=["a", "b"], n=2).n == 2


def test_missing_messages_and_bad_json_are_vllms_validation_errors() -> None:
    with pytest.raises(ApiError, match=re.escape("'loc': 'body.messages', 'msg': 'Field required'")) as missing:
        parse_generation({}, chat=True, served_model="m", vocab_size=VOCAB, max_model_len=CONTEXT)
    assert (missing.value.err_type, missing.value.param) == ("Bad Request", "body.messages")
    with pytest.raises(ApiError, match="Either prompt or prompt_embeds") as no_prompt:
        parse_generation({}, chat=False, served_model="m", vocab_size=VOCAB, max_model_len=CONTEXT)
    assert no_prompt.value.param == "prompt"
    with pytest.raises(ApiError, match=re.escape("'ctx': {'error': 'Expecting value'}")) as broken:
        decode_body(b'{"model": "m", "messages": [')
    assert broken.value.param == "body.28"
    with pytest.raises(ApiError, match="Input should be a valid dictionary") as listed:
        decode_body(b"[1, 2]")
    assert listed.value.param == "body"
    with pytest.raises(ApiError, match="Field required") as empty:
        decode_body(b"")
    assert empty.value.param == "body"


def test_accepted_parameters() -> None:
    spec = _chat(max_completion_tokens=9, max_tokens=3, stream=True,
                 stream_options={"include_usage": True}, temperature=0.2, top_p=0.9, seed=4,
                 stop=["\n"], priority=-3, user="u1", ignore_eos=True, min_tokens=2,
                 tools=[{"type": "function", "function": {"name": "f"}}],
                 response_format={"type": "json_object"}, logprobs=True, top_logprobs=2)
    assert spec.max_tokens == 9  # max_completion_tokens wins, as in vLLM
    assert spec.stream and spec.include_usage and spec.ignore_eos
    assert spec.priority == -3 and spec.seed == 4 and spec.logprobs == 2
    assert _chat(messages=[{"role": "user", "content": "x"}],
                 add_generation_prompt=False).role == "user"


def test_context_length_errors_use_vllms_text() -> None:
    too_big = _error(_completion, prompt="hi", max_tokens=8193)
    assert too_big.param == "max_tokens"
    assert too_big.message == ("max_tokens=8193 cannot be greater than max_model_len=8192. Please request "
                               "fewer output tokens. (parameter=max_tokens, value=8193)")
    assert _error(_chat, max_completion_tokens=9000).param == "max_completion_tokens"
    with pytest.raises(ApiError) as ids:
        check_context(9000, 8192)
    assert ids.value.param == "input_tokens"
    assert "your prompt contains 9000 input tokens, which exceeds this limit" in ids.value.message
    with pytest.raises(ApiError, match="contains at least 8193 input tokens"):
        check_context(9000, 8192, from_text=True)
    check_context(8192, 8192)
    # A prompt that fills the window leaves a budget of 0; one that fits is cut to what is left.
    assert _error(_completion, prompt=[5] * CONTEXT).message == (
        "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)")
    assert _completion(prompt=[5] * 8100, max_tokens=500).max_tokens == 500


def test_output_plan() -> None:
    prompt = tokenize("tell me a story")
    exact = plan_output(_chat(max_tokens=77), prompt, 8192, 0)
    assert exact[:2] == (77, "length")
    assert plan_output(_chat(max_tokens=77), prompt, len(prompt) + 10, 0)[:2] == (10, "length")
    assert plan_output(_chat(ignore_eos=True), prompt, 8192, 0)[:2] == (8192 - len(prompt), "length")
    assert plan_output(_chat(n=2), prompt, 8192, 0, 1)[2] != plan_output(_chat(n=2), prompt, 8192, 0, 0)[2]
    natural = plan_output(_chat(), prompt, 8192, 0)
    assert 16 <= natural[0] <= 256 and natural[1] == "stop"
    assert plan_output(_chat(), prompt, 8192, 0) == natural  # deterministic
    assert plan_output(_chat(seed=5), prompt, 8192, 0)[2] != natural[2]
    assert plan_output(_chat(min_tokens=300), prompt, 8192, 0)[0] == 300
    capped = plan_output(_chat(), prompt, len(prompt) + 10, 0)
    assert capped == (10, "length", capped[2])


def test_a_stop_string_ends_the_output_where_its_text_first_shows() -> None:
    text = "".join(VOCAB_TEXT[t] for t in filler_ids(7, 0, 200))
    word = text.split(" ")[3]  # a word some way in
    count, stop, visible = find_stop(7, 200, ("zzz", " " + word)) or (0, "", 0)
    assert stop == " " + word and visible == text.index(" " + word)
    assert len("".join(VOCAB_TEXT[t] for t in filler_ids(7, 0, count))) >= visible + len(stop)
    assert len("".join(VOCAB_TEXT[t] for t in filler_ids(7, 0, count - 1))) < visible + len(stop)
    assert find_stop(7, 200, ("zzz",)) is None
    assert _chat(stop="x").stop == ("x",)
    assert _error(_chat, stop=["x", ""]).message == "stop cannot contain an empty string."
