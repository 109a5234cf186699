"""Response shapes: the byte-template fast path builds exactly the chunks the dict path builds."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from switchyard.sim.logprobs import chat_logprobs, completion_logprobs, top_logprobs
from switchyard.sim.responses import ChoiceOutput, ResponseShaper, Usage, system_fingerprint
from switchyard.simtext.tokens import VOCAB_TEXT, filler_ids

IDS = filler_ids(11, 0, 4)


def _events(raw: bytes) -> list[Any]:
    return [msgspec.json.decode(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e]


def _shaper(chat: bool, include_usage: bool) -> ResponseShaper:
    return ResponseShaper(chat=chat, model="m", request_id="abc", choices=2, fingerprint="vllm-0.32.0-x",
                          include_usage=include_usage)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no_usage"])
@pytest.mark.parametrize("stop", [None, " the"])
def test_fast_and_dict_chunks_agree(chat: bool, include_usage: bool, stop: str | None) -> None:
    shaper = _shaper(chat, include_usage)
    cut = "xy" if stop else None
    fast = _events(shaper.token_chunks(1, IDS, "stop" if stop else "length", stop, cut))
    slow = [_events(shaper.chunk(1, [t], None))[0] for t in IDS[:-1]]
    slow += _events(shaper.chunk(1, IDS[-1:], "stop" if stop else "length", stop_reason=stop, text=cut))
    assert fast == slow
    last = fast[-1]
    assert ("system_fingerprint" in last) is not include_usage
    assert last["choices"][0]["stop_reason"] == stop
    assert "stop_reason" not in fast[0]["choices"][0] or not chat
    text = [c["choices"][0]["delta"]["content"] if chat else c["choices"][0]["text"] for c in fast]
    assert text == [VOCAB_TEXT[t] for t in IDS[:-1]] + [cut or VOCAB_TEXT[IDS[-1]]]


def test_usage_in_vllms_three_forms() -> None:
    usage = Usage(prompt_tokens=300, completion_tokens=4, cached_tokens=256, created_cache_tokens=0)
    assert usage.body(chat=True, stream=False)["prompt_tokens_details"] == {
        "cached_tokens": 256, "created_cache_tokens": 0, "multimodal_tokens": None}
    assert usage.body(chat=False, stream=False)["prompt_tokens_details"]["created_cache_tokens"] is None
    assert usage.body(chat=False, stream=False)["completion_tokens_details"] is None
    assert usage.body(chat=True, stream=True)["prompt_tokens_details"] == {"cached_tokens": 256,
                                                                           "created_cache_tokens": 0}
    assert usage.body(chat=False, stream=True) == {"prompt_tokens": 300, "total_tokens": 304, "completion_tokens": 4,
                                                   "prompt_tokens_details": {"cached_tokens": 256}}
    assert usage.running(chat=True) == {"prompt_tokens": 300, "total_tokens": 304, "completion_tokens": 4,
                                        "completion_tokens_details": None}


def test_full_bodies_carry_vllms_fields() -> None:
    usage = Usage(5, 2, 0, 0)
    chat = msgspec.json.decode(_shaper(True, False).full_body([ChoiceOutput("hi", "length")], usage))
    assert chat["choices"][0]["message"]["reasoning"] is None and "tool_calls" not in chat["choices"][0]["message"]
    assert chat["system_fingerprint"] == "vllm-0.32.0-x" and chat["choices"][0]["routed_experts"] is None
    text = msgspec.json.decode(_shaper(False, False).full_body([ChoiceOutput("hi", "stop", " x")], usage))
    assert text["choices"][0]["stop_reason"] == " x" and "prompt_text" not in text


def test_fingerprint_is_stable_per_setup() -> None:
    assert system_fingerprint("m", 512) == system_fingerprint("m", 512) != system_fingerprint("m", 1024)
    assert system_fingerprint("m").startswith("vllm-0.32.0-")


def test_logprobs_are_deterministic_and_rank_the_sampled_token_first() -> None:
    top = top_logprobs(3, 7, IDS[0], 4)
    assert top == top_logprobs(3, 7, IDS[0], 4)
    assert len(top) == 4 and top[0][0] == VOCAB_TEXT[IDS[0]]
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert all(lp < 0 for _, lp in top)
    chat = chat_logprobs(3, 0, IDS, 2)["content"]
    assert [c["token"] for c in chat] == [VOCAB_TEXT[t] for t in IDS]
    assert all(len(c["top_logprobs"]) == 2 for c in chat)
    assert chat_logprobs(3, 0, IDS, 0)["content"][0]["top_logprobs"] == []
    text = completion_logprobs(3, 0, IDS, 1, 10)
    assert text["text_offset"][0] == 10
    assert text["text_offset"][1] == 10 + len(VOCAB_TEXT[IDS[0]])
    assert all(len(d) == 1 for d in text["top_logprobs"])
