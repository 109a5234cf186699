"""The request that continues a broken answer: the text so far as a final assistant message to continue (chat),
or after the prompt (completions), with the output budget left and the usage chunk always asked for."""

from __future__ import annotations

from switchyard.gateway.resume import continuation_body

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True}


def test_a_chat_answer_is_continued_as_its_final_assistant_message() -> None:
    body = continuation_body("chat", CHAT, "Once upon", 2, 48)
    assert body["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 48 and body["stream_options"] == {"include_usage": True}
    assert CHAT["messages"] == [{"role": "user", "content": "hi"}]  # the client's body is left as it was


def test_a_message_the_client_was_continuing_itself_grows_and_its_budget_names_stay() -> None:
    own = {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Dear"}],
           "continue_final_message": True, "add_generation_prompt": False, "max_completion_tokens": 30,
           "min_tokens": 5, "stream_options": {"include_usage": False}}
    body = continuation_body("chat", own, " Sir", 3, 27)
    assert body["messages"][-1] == {"role": "assistant", "content": "Dear Sir"} and len(body["messages"]) == 2
    assert body["max_completion_tokens"] == 27 and "max_tokens" not in body and body["min_tokens"] == 2
    assert body["stream_options"] == {"include_usage": True}


def test_a_completion_continues_from_its_prompt_plus_the_text_and_no_text_is_the_request_again() -> None:
    body = continuation_body("completion", {"model": "m", "prompt": "Once", "stream": True}, " upon", 1, None)
    assert body["prompt"] == "Once upon" and "max_tokens" not in body
    again = continuation_body("chat", CHAT, "", 0, 50)
    assert again["messages"] == CHAT["messages"] and "continue_final_message" not in again
