"""``continue_final_message`` on chat completions, as vLLM 0.32 renders, refuses and answers it.

vLLM's facts (its sources, 0.32): ``ChatCompletionRequest.check_generation_prompt`` (a "before" model
validator in ``entrypoints/openai/chat_completion/protocol.py``) refuses a body whose raw
``continue_final_message`` and ``add_generation_prompt`` are both truthy; with ``add_generation_prompt``
left at its default (true) the request passes it and transformers' ``apply_chat_template`` refuses the
pair (its ValueError answered as a 400 by ``renderers/hf.py``); the template is rendered with the final
message left open (cut after its text); and the answer's role is the last message's
(``OpenAIServingChat.get_chat_request_role``), in the stream's first chunk too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from litestar.testing import AsyncTestClient

from switchyard.sim import EngineConfig, create_engine_app
from switchyard.sim.protocol import ApiError, GenerationSpec, parse_generation
from switchyard.simtext.chat import BOTH_FLAGS, NO_TEXT_TO_CONTINUE, ChatFormatError, render_chat
from switchyard.simtext.tokens import SPECIAL_TOKENS, tokenize

EOT = SPECIAL_TOKENS["<|eot_id|>"]
STORY = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
BOTH = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def _chat(**body: Any) -> GenerationSpec:
    body.setdefault("messages", STORY)
    return parse_generation(body, chat=True, served_model="m", vocab_size=128_256, max_model_len=8192)


def _error(**body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        _chat(**body)
    return info.value


def test_the_final_message_is_left_open() -> None:
    closed = render_chat(STORY, add_generation_prompt=False)
    opened = render_chat(STORY, add_generation_prompt=False, continue_final_message=True)
    assert closed[-1] == EOT and opened == closed[:-1]  # no end of turn after it, no generation prompt
    assert opened[-len(tokenize("Once upon a")):] == tokenize("Once upon a")
    # Whatever the template writes after the text goes too (tool calls), and media after the last text.
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    calls = [*STORY[:1], {"role": "assistant", "content": "Let me look", "tool_calls": [call]}]
    assert render_chat(calls, add_generation_prompt=False, continue_final_message=True) == \
        render_chat([*calls[:1], {"role": "assistant", "content": "Let me look"}], add_generation_prompt=False,
                    continue_final_message=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Once upon a"},
                                          {"type": "image_url", "image_url": {"url": "http://x/1.png"}}]}]
    assert render_chat(parts, add_generation_prompt=False, continue_final_message=True) == \
        render_chat([{"role": "user", "content": "Once upon a"}], add_generation_prompt=False,
                    continue_final_message=True)
    # A message with no content is continued from its header.
    empty = render_chat([{"role": "assistant", "content": None}], add_generation_prompt=False,
                        continue_final_message=True)
    assert empty == tokenize("<|begin_of_text|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_the_template_refuses_what_transformers_refuses() -> None:
    with pytest.raises(ChatFormatError) as both:
        render_chat(STORY, continue_final_message=True)
    assert str(both.value).startswith("continue_final_message and add_generation_prompt are not compatible. ")
    images = [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "http://x/1.png"}}]}]
    with pytest.raises(ChatFormatError) as info:
        render_chat(images, add_generation_prompt=False, continue_final_message=True)
    assert str(info.value) == NO_TEXT_TO_CONTINUE


@pytest.mark.parametrize("body", [
    {"continue_final_message": True, "add_generation_prompt": True},
    {"continue_final_message": 1, "add_generation_prompt": "false"},  # the raw values' truth, as vLLM reads them
    # vLLM's validator runs before pydantic reads any field: it wins over every other mistake.
    {"continue_final_message": True, "add_generation_prompt": True, "max_tokens": "many", "model": "other"},
    {"continue_final_message": True, "add_generation_prompt": True, "messages": "not a list"},
])
def test_both_flags_are_refused_first(body: dict[str, Any]) -> None:
    err = _error(**body)
    assert (err.status, err.err_type, err.param, err.message) == (400, "BadRequestError", None, BOTH)


def test_continue_without_turning_the_generation_prompt_off_is_the_templates_400() -> None:
    err = _error(continue_final_message=True)
    assert (err.status, err.err_type, err.param, err.message) == (400, "BadRequestError", None, BOTH_FLAGS)
    # Other checks that come first in vLLM still come first.
    assert _error(continue_final_message=True, model="other").status == 404
    assert _error(continue_final_message="maybe", add_generation_prompt=False).param == \
        "body.continue_final_message"


def test_a_continued_chat_is_parsed() -> None:
    spec = _chat(continue_final_message=True, add_generation_prompt=False)
    assert spec.continues and spec.role == "assistant"
    assert spec.prompts == [render_chat(STORY, add_generation_prompt=False, continue_final_message=True)]
    user_last = _chat(messages=STORY[:1], continue_final_message="true", add_generation_prompt=0)
    assert user_last.continues and user_last.role == "user"  # vLLM: the last message's role, whatever it is
    assert not _chat(continue_final_message=False).continues


@pytest.fixture
async def client() -> AsyncIterator[AsyncTestClient]:  # type: ignore[type-arg]
    app = create_engine_app(EngineConfig(served_model="m", port=1, time_scale=1000, seed=1))
    async with AsyncTestClient(app=app) as c:
        yield c


async def test_a_continued_answer_goes_on_from_the_final_message(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    body = {"messages": STORY, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 6}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant"
    # The text continues the sentence (no new one starting, and the final message is not repeated).
    assert message["content"].startswith(" ") and not message["content"].startswith(" Once upon a")
    expected = render_chat(STORY, add_generation_prompt=False, continue_final_message=True)
    assert answer["usage"]["prompt_tokens"] == len(expected)
    tokenized = await client.post("/tokenize", json={"messages": STORY, "continue_final_message": True,
                                                     "add_generation_prompt": False})
    assert tokenized.json()["tokens"] == expected
    # A fresh answer to the same chat (no continuation) starts a sentence and counts the end of turn.
    fresh = (await client.post("/v1/chat/completions", json={**body, "continue_final_message": False})).json()
    assert fresh["usage"]["prompt_tokens"] == len(expected) + 1
    assert fresh["choices"][0]["message"]["content"][0].isupper()

    streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    events = [e.removeprefix("data: ") for e in streamed.text.split("\n\n") if e]
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == message["content"]


async def test_the_flags_are_refused_over_http(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    for path in ("/v1/chat/completions", "/tokenize"):
        resp = await client.post(path, json={"messages": STORY, "continue_final_message": True,
                                             "add_generation_prompt": True})
        assert resp.status_code == 400
        assert resp.json() == {"error": {"message": BOTH, "type": "BadRequestError", "param": None, "code": 400}}
    resp = await client.post("/v1/chat/completions", json={"messages": STORY, "continue_final_message": True})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == BOTH_FLAGS
    state = (await client.get("/sim/state")).json()
    assert state["steps"] == 0 and state["in_flight"] == 0
