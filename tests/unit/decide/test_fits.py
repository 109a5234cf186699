"""A request its model cannot serve is refused before it runs, in vLLM's words; estimates only when certain."""

from __future__ import annotations

import pytest

from switchyard.decide.admit import CHAT_TEMPLATE_SLACK, ESTIMATE_MARGIN, DoesNotFit, check_fits, expected_output
from switchyard.decide.features import chat_features, completion_features, count_prompts
from switchyard.decide.tokens import ESTIMATE
from switchyard.policy import compile_policy
from tests.unit.policy.base import base, to_yaml

DOC = base()
DOC["models"][1]["max_output_tokens"] = 4096  # large: 32768-token window, at most 4096 output tokens
SNAP = compile_policy(to_yaml(DOC))
SMALL, LARGE = SNAP.models["small"], SNAP.models["large"]  # small: 8192-token window, no output cap


def refusal(*args: object, **kwargs: object) -> DoesNotFit:
    with pytest.raises(DoesNotFit) as caught:
        check_fits(*args, **kwargs)  # type: ignore[arg-type]
    return caught.value


def test_max_tokens_above_the_context_window_is_refused_like_vllm() -> None:
    check_fits(SMALL, "chat", 10, True, 8182)
    error = refusal(SMALL, "chat", 10, True, 8193)
    assert (error.code, error.param) == ("invalid_value", "max_tokens")
    assert error.message == ("max_tokens=8193 cannot be greater than max_model_len=8192. "
                             "Please request fewer output tokens.")
    assert refusal(SMALL, "chat", 1, False, 9000, "max_completion_tokens").param == "max_completion_tokens"


def test_max_tokens_above_the_models_output_cap_is_refused_even_inside_the_window() -> None:
    check_fits(LARGE, "completion", 10, True, 4096)
    error = refusal(LARGE, "completion", 10, True, 4097)
    assert (error.code, error.param) == ("invalid_value", "max_tokens")
    assert "max_tokens=4097 cannot be greater than 4096" in error.message


def test_an_exactly_counted_prompt_longer_than_the_window_is_refused() -> None:
    check_fits(SMALL, "completion", 8192, True, None)
    error = refusal(SMALL, "completion", 8193, True, None)
    assert (error.code, error.param) == ("context_length_exceeded", "prompt")
    assert error.message == ("This model's maximum context length is 8192 tokens. However, your prompt contains "
                             "8193 input tokens, which exceeds this limit even without any output tokens. "
                             "Please reduce the length of the input prompt.")


def test_prompt_plus_max_tokens_beyond_the_window_is_refused_with_both_counts() -> None:
    check_fits(SMALL, "completion", 8000, True, 192)
    error = refusal(SMALL, "completion", 8000, True, 193)
    assert (error.code, error.param) == ("context_length_exceeded", "prompt")
    assert error.message == ("This model's maximum context length is 8192 tokens. However, you requested 8193 "
                             "tokens (8000 in the prompt, 193 in the completion). Please reduce the length of the "
                             "prompt or completion.")
    chat = refusal(SMALL, "chat", 8000, True, 500)
    assert (chat.param, chat.code) == ("messages", "context_length_exceeded")
    assert "you requested 8500 tokens (8000 in the messages, 500 in the completion)" in chat.message


def test_a_chat_counted_with_a_tokenizer_keeps_a_few_tokens_for_the_estimated_template() -> None:
    check_fits(SMALL, "chat", 8192 + CHAT_TEMPLATE_SLACK, True, None)  # may be the engine's 8192
    assert refusal(SMALL, "chat", 8193 + CHAT_TEMPLATE_SLACK, True, None).param == "messages"
    check_fits(SMALL, "chat", 8100 + CHAT_TEMPLATE_SLACK, True, 92)
    refusal(SMALL, "chat", 8100 + CHAT_TEMPLATE_SLACK, True, 93)


def test_an_estimated_prompt_is_refused_only_when_far_over() -> None:
    window = SMALL.context_window
    check_fits(SMALL, "chat", 2 * window, False, None)  # the engine may count it shorter: it decides
    check_fits(SMALL, "chat", ESTIMATE_MARGIN * window, False, None)
    error = refusal(SMALL, "chat", ESTIMATE_MARGIN * (window + 1), False, None)
    assert error.code == "context_length_exceeded"
    assert f"an estimated {ESTIMATE_MARGIN * (window + 1)} (at least {window + 1}) input tokens" in error.message
    check_fits(SMALL, "chat", 4000, False, 7000)  # at least 1000 + 7000 fits
    error = refusal(SMALL, "chat", 4000, False, 7193)
    assert "you requested at least 8193 tokens (at least 1000 in the messages, 7193 in the completion)" in error.message


def test_the_reservation_still_counts_only_what_the_window_leaves_of_an_estimated_prompt() -> None:
    check_fits(SMALL, "chat", 9000, False, 1000)  # estimated: goes on to the engine, which cuts the output
    assert expected_output(SMALL, 9000, 1000) == 0
    assert expected_output(SMALL, 8000, 1000) == 192


def test_features_know_the_longest_of_several_prompts_and_when_token_ids_are_exact() -> None:
    one = completion_features({"model": "small", "prompt": list(range(300))}, {})
    assert (one.prompt_tokens, one.longest_prompt, one.prompt_exact) == (300, None, True)
    several = completion_features({"model": "small", "prompt": [list(range(300)), list(range(50))]}, {})
    assert (several.prompt_tokens, several.longest_prompt, several.prompt_exact) == (350, 300, True)
    mixed = completion_features({"model": "small", "prompt": ["a" * 400, list(range(50))]}, {})
    assert (mixed.prompt_tokens, mixed.longest_prompt, mixed.prompt_exact) == (150, 100, False)
    text = completion_features({"model": "small", "prompt": "a" * 400}, {})
    assert (text.prompt_tokens, text.longest_prompt, text.prompt_exact) == (100, None, False)
    chat = chat_features({"model": "small", "messages": [{"role": "user", "content": "a" * 400}]}, {})
    assert (chat.longest_prompt, chat.prompt_exact) == (None, False)
    assert count_prompts(ESTIMATE, "completion", {"prompt": ["a" * 400, list(range(50))]}) == (150, 100)
    assert count_prompts(ESTIMATE, "chat", {"messages": [{"role": "user", "content": "a" * 400}]}) == (104, 104)
