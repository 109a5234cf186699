"""Cached answers: vLLM streams assembled whole, whole answers replayed as streams the OpenAI SDK reads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.gateway.cache_assemble import assemble
from switchyard.gateway.cache_replay import DONE, Kind, for_client, replay
from switchyard.sim.logprobs import chat_logprobs, completion_logprobs
from switchyard.sim.responses import ChoiceOutput, ResponseShaper, Usage
from switchyard.simtext.tokens import detokenize, filler_ids
from tests.conformance.observe import assert_shape, shape

# vLLM 0.32's chunk shapes, as the conformance suite checks them against a real server.
from tests.conformance.test_conformance import (
    CHAT_CHUNK,
    CHAT_LAST_CHUNK,
    CHAT_USAGE_CHUNK,
    ROLE_CHUNK,
    TEXT_CHUNK,
    TEXT_LAST_CHUNK,
    TEXT_USAGE_CHUNK,
)

FP = "vllm-0.32.0-abcdef12"
MESSAGES: Any = [{"role": "user", "content": "hi"}]



def sim_answer(chat: bool, lengths: list[int], *, logprobs: int | None = None, stop: str | None = None,
               include_usage: bool = True, reason: str | None = None) -> tuple[bytes, bytes]:
    """One answer as the simulator (vLLM's shapes) streams it and as it answers unstreamed.

    Choice ``i`` generates ``lengths[i]`` tokens, three per engine step, choices interleaved.
    """
    shaper = ResponseShaper(chat=chat, model="m", request_id="req", choices=len(lengths), fingerprint=FP,
                            include_usage=include_usage)
    outputs = [filler_ids(7 + i, 0, n) for i, n in enumerate(lengths)]
    finish = reason or ("stop" if stop else "length")
    parts = [shaper.role_chunk(i) for i in range(len(lengths))] if chat else []

    def token_logprobs(i: int, start: int, ids: list[int]) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        if chat:
            return chat_logprobs(i, start, ids, logprobs)
        return completion_logprobs(i, start, ids, logprobs, len(detokenize(outputs[i][:start])))

    for start in range(0, max(lengths), 3):
        for i, ids in enumerate(outputs):
            piece = ids[start:start + 3]
            final = start + 3 >= len(ids)
            if not piece:
                continue
            if logprobs is None:
                parts.append(shaper.token_chunks(i, piece, finish if final else None, stop if final else None))
                continue
            for k, token in enumerate(piece):
                last = final and k == len(piece) - 1
                parts.append(shaper.chunk(i, [token], finish if last else None, token_logprobs(i, start + k, [token]),
                                          stop_reason=stop if last else None))
    usage = Usage(prompt_tokens=40, completion_tokens=sum(lengths), cached_tokens=16, created_cache_tokens=16)
    if include_usage:
        parts.append(shaper.usage_chunk(usage))
    parts.append(DONE)
    full = shaper.full_body([ChoiceOutput(detokenize(ids), finish, stop, token_logprobs(i, 0, ids))
                             for i, ids in enumerate(outputs)], usage)
    return b"".join(parts), full


def sse(*chunks: dict[str, Any]) -> bytes:
    """Hand-written chunks as an event stream ending in [DONE]."""
    return b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks) + DONE


def tool_stream(content: str = "", n: int = 1) -> bytes:
    """A chat stream in vLLM's shape (hermes tool parser) with reasoning and two tool calls per choice."""
    head = {"id": "chatcmpl-tools", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish:
            choice["stop_reason"] = None
        return {**head, "choices": [{**choice, "token_ids": None}]}

    chunks: list[dict[str, Any]] = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}],
                                     "prompt_token_ids": None, "prompt_text": None} for i in range(n)]
    for i in range(n):
        chunks += [chunk(i, {"reasoning": "The user wants "}), chunk(i, {"reasoning": f"weather {i}."})]
        if content:
            chunks.append(chunk(i, {"content": content}))
        for t, (name, args) in enumerate([("get_weather", ['{"city": ', f'"Paris {i}"', "}"]),
                                          ("get_time", ['{"tz": "CET"}'])]):
            chunks.append(chunk(i, {"tool_calls": [{"id": f"chatcmpl-tool-{i}{t}", "type": "function", "index": t,
                                                    "function": {"name": name}}]}))
            chunks += [chunk(i, {"tool_calls": [{"index": t, "function": {"arguments": a}}]}) for a in args]
        chunks.append(chunk(i, {"content": ""}, "tool_calls"))
    usage = {"prompt_tokens": 90, "total_tokens": 120, "completion_tokens": 30,
             "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 80}}
    chunks.append({**head, "choices": [], "usage": usage, "system_fingerprint": FP})
    return sse(*chunks)


def events(raw: bytes) -> list[Any]:
    """The JSON chunks of a stream that must end in [DONE], each event framed as vLLM frames it."""
    assert raw.endswith(DONE) and raw.count(DONE) == 1
    frames = raw[:-len(DONE)].split(b"\n\n")
    assert frames[-1] == b"" and all(f.startswith(b"data: {") for f in frames[:-1])
    return [msgspec.json.decode(f.removeprefix(b"data: ")) for f in frames[:-1]]


def decode(raw: bytes | None) -> Any:
    assert raw is not None
    return msgspec.json.decode(raw)


STREAMS: dict[str, tuple[Kind, bytes]] = {
    "chat": ("chat", sim_answer(True, [40])[0]),
    "chat_n2": ("chat", sim_answer(True, [35, 8])[0]),
    "chat_logprobs": ("chat", sim_answer(True, [20, 11], logprobs=2)[0]),
    "chat_stop": ("chat", sim_answer(True, [9], stop=" cache")[0]),
    "chat_tools": ("chat", tool_stream()),
    "chat_tools_n2_with_text": ("chat", tool_stream("Let me check.", n=2)),
    "completion": ("completion", sim_answer(False, [50])[0]),
    "completion_n2_logprobs": ("completion", sim_answer(False, [12, 30], logprobs=3)[0]),
    "completion_stop": ("completion", sim_answer(False, [5, 7], stop="\n")[0]),
}


# --- assemble -------------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
@pytest.mark.parametrize("case", [{"lengths": [30]}, {"lengths": [17, 4]}, {"lengths": [9, 9], "logprobs": 2},
                                  {"lengths": [6], "stop": "x"}, {"lengths": [1]}],
                         ids=["n1", "n2", "logprobs", "stop", "one_token"])
def test_assembles_exactly_what_vllm_answers_unstreamed(chat: bool, case: dict[str, Any]) -> None:
    stream, full = sim_answer(chat, **case)
    assert decode(assemble("chat" if chat else "completion", stream)) == decode(full)


def test_assembles_tool_calls_and_reasoning() -> None:
    answer = decode(assemble("chat", tool_stream()))
    message = answer["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"] == "The user wants weather 0."
    assert message["tool_calls"] == [
        {"id": "chatcmpl-tool-00", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris 0"}'}},
        {"id": "chatcmpl-tool-01", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}},
    ]
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 80,
                                                        "multimodal_tokens": None}
    assert answer["system_fingerprint"] == FP and answer["object"] == "chat.completion"
    assert decode(assemble("chat", tool_stream("Let me check.", n=2)))["choices"][1]["message"]["content"] == (
        "Let me check.")


def test_assembles_openai_style_streams_and_reasoning_content() -> None:
    """OpenAI's shape: ``usage: null`` on every chunk, no vLLM extras; ``reasoning_content`` kept."""
    head = {"id": "chatcmpl-o", "object": "chat.completion.chunk", "created": 1, "model": "gpt"}
    stream = sse(
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "refusal": None},
                              "finish_reason": None}], "usage": None},
        {**head, "choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}, "finish_reason": None}],
         "usage": None},
        {**head, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}], "usage": None},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": None},
        {**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
    )
    answer = decode(assemble("chat", stream))
    assert answer["choices"][0]["message"]["content"] == "Hi"
    assert answer["choices"][0]["message"]["reasoning_content"] == "hmm"
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                               "prompt_tokens_details": None, "completion_tokens_details": None}
    assert decode(assemble("chat", replay("chat", msgspec.json.encode(answer), include_usage=True))) == answer


def _good() -> bytes:
    return sim_answer(True, [5])[0]


def _with_last_event(raw: bytes, event: bytes) -> bytes:
    return raw[:-len(DONE)] + event + DONE


@pytest.mark.parametrize(("kind", "stream"), [
    ("chat", _good()[:-len(DONE)]),
    ("chat", _good()[:-1]),
    ("chat", _with_last_event(_good(), b'data: {"error": {"message": "boom", "type": "InternalServerError", '
                                       b'"param": null, "code": 500}}\n\n')),
    ("chat", _with_last_event(_good(), b'data: {"object": "error", "message": "boom", "code": 500}\n\n')),
    ("chat", b"event: error\n" + _good()),
    ("chat", _good() + DONE),
    ("chat", _good().replace(b"data: {", b"data: {{", 1)),
    ("chat", sim_answer(True, [5], include_usage=False)[0]),
    ("chat", sim_answer(True, [5], reason="abort")[0]),
    ("chat", sim_answer(True, [5], reason="error")[0]),
    ("completion", sim_answer(False, [5], reason="abort")[0]),
    ("completion", _good()),
    ("chat", b""),
    ("chat", DONE),
    ("chat", _good().replace(b'"prompt_text":null', b'"prompt_text":null,"prompt_logprobs":[null]', 1)),
], ids=["no_done", "done_unterminated", "error_event", "error_object", "sse_error_event", "after_done",
        "bad_json", "no_usage", "abort", "finish_error", "completion_abort", "wrong_kind", "empty", "only_done",
        "prompt_logprobs"])
def test_streams_that_must_not_be_cached(kind: Kind, stream: bytes) -> None:
    assert assemble(kind, stream) is None


def test_a_choice_without_finish_reason_is_not_cached() -> None:
    shaper = ResponseShaper(chat=True, model="m", request_id="x", choices=2, fingerprint=FP, include_usage=True)
    ids = filler_ids(1, 0, 4)
    stream = (shaper.role_chunk(0) + shaper.role_chunk(1) + shaper.token_chunks(0, ids, "length")
              + shaper.token_chunks(1, ids, None) + shaper.usage_chunk(Usage(3, 8, 0, 0)) + DONE)
    assert assemble("chat", stream) is None
    after_finish = stream.replace(shaper.usage_chunk(Usage(3, 8, 0, 0)), shaper.token_chunks(1, ids[:1], "stop")
                                  + shaper.token_chunks(1, ids[:1], None) + shaper.usage_chunk(Usage(3, 8, 0, 0)))
    assert assemble("chat", after_finish) is None


@pytest.mark.parametrize("name", ["chat_n2", "completion_n2_logprobs", "chat_tools"])
def test_no_truncated_stream_is_cached(name: str) -> None:
    kind, stream = STREAMS[name]
    assert assemble(kind, stream) is not None
    assert all(assemble(kind, stream[:cut]) is None for cut in range(0, len(stream), 7))


# --- replay ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [1, 3, 16, 1000])
@pytest.mark.parametrize("name", list(STREAMS))
def test_replay_then_assemble_gives_the_answer_back(name: str, chunk_tokens: int) -> None:
    kind, stream = STREAMS[name]
    answer = assemble(kind, stream)
    assert answer is not None
    again = assemble(kind, replay(kind, answer, include_usage=True, chunk_tokens=chunk_tokens))
    assert decode(again) == decode(answer)


@pytest.mark.parametrize("name", ["chat_logprobs", "completion_n2_logprobs"])
def test_token_ids_and_tokens_that_do_not_spell_the_text_survive_a_replay(name: str) -> None:
    """``return_token_ids``, ``return_tokens_as_token_ids``: per-token lists are split in proportion."""
    kind, stream = STREAMS[name]
    answer = decode(assemble(kind, stream))
    for number, choice in enumerate(answer["choices"]):
        logprobs = choice["logprobs"]
        if kind == "chat":
            for entry in logprobs["content"]:
                entry["token"] = f"token_id:{len(entry['token'])}"
            count = len(logprobs["content"])
        else:
            logprobs["tokens"] = [f"token_id:{len(t)}" for t in logprobs["tokens"]]
            count = len(logprobs["tokens"])
        choice["token_ids"] = list(range(100 * number, 100 * number + count + number))  # one extra on choice 1
    raw = msgspec.json.encode(answer)
    for chunk_tokens in (1, 2, 7):
        replayed = replay(kind, raw, include_usage=True, chunk_tokens=chunk_tokens)
        assert decode(assemble(kind, replayed)) == answer
        assert sum(1 for c in events(replayed) if c["choices"] and c["choices"][0].get("token_ids")) > 2


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_an_unstreamed_vllm_answer_replays_to_itself(chat: bool) -> None:
    kind: Kind = "chat" if chat else "completion"
    for case in ({"lengths": [30, 2]}, {"lengths": [12], "logprobs": 2, "stop": "x"}):
        full = sim_answer(chat, **case)[1]
        assert decode(assemble(kind, replay(kind, full, include_usage=True, chunk_tokens=5))) == decode(full)


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.text(), min_size=1, max_size=3), chunk_tokens=st.integers(1, 6), chat=st.booleans())
def test_any_text_replays_to_itself(texts: list[str], chunk_tokens: int, chat: bool) -> None:
    kind: Kind = "chat" if chat else "completion"
    shaper = ResponseShaper(chat=chat, model="m", request_id="p", choices=len(texts), fingerprint=FP)
    full = shaper.full_body([ChoiceOutput(t, "stop") for t in texts], Usage(3, 9, 0, 0))
    replayed = replay(kind, full, include_usage=True, chunk_tokens=chunk_tokens)
    assert decode(assemble(kind, replayed)) == decode(full)


@pytest.mark.parametrize("include_usage", [True, False], ids=["include_usage", "no_usage"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_replayed_chunks_have_vllms_shapes(chat: bool, include_usage: bool) -> None:
    kind: Kind = "chat" if chat else "completion"
    answer = assemble(kind, sim_answer(chat, [200, 3])[0])
    assert answer is not None
    chunks = events(replay(kind, answer, include_usage=include_usage, chunk_tokens=16))
    head = {k: decode(answer)[k] for k in ("id", "created", "model")}
    assert all({k: c[k] for k in head} == head for c in chunks)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    usage = chunks.pop() if include_usage else None
    if chat:
        roles = chunks[:2]
        chunks = chunks[2:]
        for role in roles:
            assert_shape(shape(role), ROLE_CHUNK, "role chunk")
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = [c for c in chunks if c["choices"][0]["finish_reason"] is not None]
    middle = [c for c in chunks if c["choices"][0]["finish_reason"] is None]
    assert [c["choices"][0]["index"] for c in last] == [1, 0]  # the short choice ends first
    assert len([c for c in middle if c["choices"][0]["index"] == 0]) >= 200 // 16 - 1
    for chunk in middle:
        assert_shape(shape(chunk), CHAT_CHUNK if chat else TEXT_CHUNK, "a chunk in mid-stream")
    for chunk in last:
        expected = CHAT_LAST_CHUNK if chat else TEXT_LAST_CHUNK
        assert_shape(shape(chunk), expected if include_usage else {**expected, "system_fingerprint": "str"}, "last")
    if usage is not None:
        assert_shape(shape(usage), CHAT_USAGE_CHUNK if chat else TEXT_USAGE_CHUNK, "the usage chunk")
        assert usage["usage"]["completion_tokens"] == 203


def test_replay_refuses_what_is_not_an_answer() -> None:
    for bad in (b"", b"{}", b"[1]", b'{"id": "x", "created": 1, "model": "m", "choices": {}}',
                b'{"id": "x", "created": 1, "model": "m", "choices": [{"message": {"content": "hi"}}]}'):
        with pytest.raises(ValueError, match="not a complete chat answer"):
            replay("chat", bad, include_usage=True)
    with pytest.raises(ValueError, match="chunk_tokens"):
        replay("chat", sim_answer(True, [3])[1], include_usage=True, chunk_tokens=0)


def test_for_client_is_the_cached_answer() -> None:
    full = sim_answer(True, [3])[1]
    assert for_client(full) == full


# --- the OpenAI SDK reads what is replayed --------------------------------------------------


def sdk(body: bytes, content_type: str, path: str) -> openai.OpenAI:
    """An OpenAI client whose server answers ``body`` to a request on ``path``."""

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == path
        return httpx.Response(200, content=body, headers={"content-type": content_type})

    # The SDK's annotations name httpx2's client; it drives an httpx client all the same.
    return openai.OpenAI(base_url="http://test/v1", api_key="k", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))  # type: ignore[arg-type]


def check_usage(seen: Any, answer: dict[str, Any]) -> None:
    assert seen is not None
    expected = answer["usage"]
    assert (seen.prompt_tokens, seen.completion_tokens, seen.total_tokens) == (
        expected["prompt_tokens"], expected["completion_tokens"], expected["total_tokens"])
    assert seen.prompt_tokens_details is not None
    assert seen.prompt_tokens_details.cached_tokens == expected["prompt_tokens_details"]["cached_tokens"]


def expected_message(choice: dict[str, Any]) -> dict[str, Any]:
    message = choice["message"]
    return {"role": "assistant", "content": message["content"] or "", "finish_reason": choice["finish_reason"],
            "tool_calls": [(t["id"], t["function"]["name"], t["function"]["arguments"])
                           for t in message.get("tool_calls", [])],
            "logprobs": [(e["token"], e["logprob"]) for e in (choice["logprobs"] or {}).get("content", [])]}


@pytest.mark.parametrize("name", [n for n in STREAMS if n.startswith("chat")])
def test_the_sdk_reads_a_replayed_chat_stream(name: str) -> None:
    answer = decode(assemble("chat", STREAMS[name][1]))
    raw = replay("chat", msgspec.json.encode(answer), include_usage=True, chunk_tokens=4)
    client = sdk(raw, "text/event-stream", "/v1/chat/completions")
    stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True})
    seen: dict[int, dict[str, Any]] = {}
    calls: dict[int, dict[int, list[str]]] = {}
    usage = None
    for chunk in stream:
        assert chunk.id == answer["id"] and chunk.model == answer["model"] and chunk.created == answer["created"]
        usage = chunk.usage or usage
        for c in chunk.choices:
            got = seen.setdefault(c.index, {"role": None, "content": "", "finish_reason": None, "tool_calls": [],
                                            "logprobs": []})
            got["role"] = c.delta.role or got["role"]
            got["content"] += c.delta.content or ""
            got["finish_reason"] = c.finish_reason or got["finish_reason"]
            for call in c.delta.tool_calls or []:
                parts = calls.setdefault(c.index, {}).setdefault(call.index, ["", "", ""])
                parts[0] += call.id or ""
                parts[1] += (call.function and call.function.name) or ""
                parts[2] += (call.function and call.function.arguments) or ""
            if c.logprobs is not None and c.logprobs.content:
                got["logprobs"] += [(e.token, e.logprob) for e in c.logprobs.content]
    for index, parts_by_call in calls.items():
        seen[index]["tool_calls"] = [tuple(parts_by_call[i]) for i in sorted(parts_by_call)]
    assert seen == {c["index"]: expected_message(c) for c in answer["choices"]}
    check_usage(usage, answer)


@pytest.mark.parametrize("name", [n for n in STREAMS if n.startswith("completion")])
def test_the_sdk_reads_a_replayed_completion_stream(name: str) -> None:
    answer = decode(assemble("completion", STREAMS[name][1]))
    raw = replay("completion", msgspec.json.encode(answer), include_usage=True, chunk_tokens=2)
    client = sdk(raw, "text/event-stream", "/v1/completions")
    seen: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in client.completions.create(model="m", prompt="hi", stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            got = seen.setdefault(c.index, {"text": "", "finish_reason": None, "tokens": []})
            got["text"] += c.text
            got["finish_reason"] = c.finish_reason or got["finish_reason"]
            got["tokens"] += (c.logprobs and c.logprobs.tokens) or []
    assert seen == {c["index"]: {"text": c["text"], "finish_reason": c["finish_reason"],
                                 "tokens": (c["logprobs"] or {}).get("tokens", [])} for c in answer["choices"]}
    check_usage(usage, answer)


def test_the_sdk_reads_a_replay_without_usage() -> None:
    answer = assemble("chat", STREAMS["chat_n2"][1])
    assert answer is not None
    client = sdk(replay("chat", answer, include_usage=False), "text/event-stream", "/v1/chat/completions")
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def _answers(prefix: str) -> Iterator[dict[str, Any]]:
    for name, (kind, stream) in STREAMS.items():
        if name.startswith(prefix):
            yield decode(assemble(kind, stream))


def test_the_sdk_reads_for_client_answers() -> None:
    for answer in _answers("chat"):
        client = sdk(for_client(msgspec.json.encode(answer)), "application/json", "/v1/chat/completions")
        resp = client.chat.completions.create(model="m", messages=MESSAGES)
        assert resp.id == answer["id"] and resp.system_fingerprint == FP
        for choice, expected in zip(resp.choices, answer["choices"], strict=True):
            calls = [(t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls or []
                     if t.type == "function"]
            assert (choice.message.content, choice.finish_reason, calls) == (
                expected["message"]["content"], expected["finish_reason"], expected_message(expected)["tool_calls"])
        check_usage(resp.usage, answer)
    for answer in _answers("completion"):
        client = sdk(for_client(msgspec.json.encode(answer)), "application/json", "/v1/completions")
        text = client.completions.create(model="m", prompt="hi")
        assert [c.text for c in text.choices] == [c["text"] for c in answer["choices"]]
        check_usage(text.usage, answer)
