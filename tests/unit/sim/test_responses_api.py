"""``POST /v1/responses`` and ``POST /detokenize`` on the engine app, in process: vLLM 0.32's shapes and errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from litestar.testing import AsyncTestClient

from switchyard.sim import EngineConfig, create_engine_app
from switchyard.sim.lora import LoraModule

#: The keys of vLLM 0.32's response object, in its order.
RESPONSE_KEYS = [
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object", "output",
    "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background", "max_output_tokens",
    "max_tool_calls", "previous_response_id", "prompt", "reasoning", "service_tier", "status", "text",
    "top_logprobs", "truncation", "usage", "user", "presence_penalty", "frequency_penalty", "kv_transfer_params",
    "ec_transfer_params", "input_messages", "output_messages"]
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added"]
CLOSING_EVENTS = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                  "response.completed"]


@pytest.fixture
async def client() -> AsyncIterator[AsyncTestClient]:  # type: ignore[type-arg]
    app = create_engine_app(EngineConfig(served_model="m", port=1, time_scale=1000, seed=1))
    async with AsyncTestClient(app=app) as c:
        yield c


def _events(body: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event, data)`` of each server-sent event, checking the framing."""
    out = []
    for block in body.split("\n\n"):
        if not block:
            continue
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        payload = msgspec.json.decode(data.removeprefix("data: "))
        assert payload["type"] == event.removeprefix("event: ")
        out.append((payload["type"], payload))
    return out


async def test_a_full_response_has_vllms_keys_and_usage(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    resp = await client.post("/v1/responses", json={
        "model": "m", "input": "Hello there", "max_output_tokens": 5, "metadata": {"k": "v"}, "user": "u1",
        "temperature": 0.5, "top_p": 0.9, "store": True})
    assert resp.status_code == 200
    body = resp.json()
    assert list(body) == RESPONSE_KEYS
    assert body["id"].startswith("resp_") and len(body["id"]) == 21
    assert body["object"] == "response" and body["model"] == "m"
    # vLLM's "incomplete" when max_output_tokens ends the answer; the simulator's output is exactly that long.
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (body["metadata"], body["user"], body["temperature"], body["top_p"]) == ({"k": "v"}, "u1", 0.5, 0.9)
    assert (body["tool_choice"], body["tools"], body["truncation"], body["service_tier"]) == (
        "none", [], "disabled", "auto")
    assert body["max_output_tokens"] == 5 and body["top_logprobs"] is None and body["background"] is False
    [item] = body["output"]
    assert list(item) == ["id", "content", "role", "status", "type", "phase"]
    assert item["id"].startswith("msg_") and item["type"] == "message" and item["status"] == "completed"
    [part] = item["content"]
    assert list(part) == ["annotations", "text", "type", "logprobs"]
    assert part["type"] == "output_text" and part["text"] and part["logprobs"] is None
    usage = body["usage"]
    assert usage == {
        "input_tokens": usage["input_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                 "cached_tokens_per_turn": []},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": usage["input_tokens"] + 5}


async def test_the_input_is_rendered_as_the_chat_it_stands_for(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    """Instructions become a system message, items become messages: the prompt is the chat's, token for token,
    after one more BOS (vLLM tokenizes the rendered template with special tokens here)."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "More"}]
    expected = (await client.post("/tokenize", json={"messages": chat})).json()["count"]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
             {"type": "message", "role": "user", "content": "More"}]
    body = (await client.post("/v1/responses", json={"input": items, "instructions": "Be brief.",
                                                     "max_output_tokens": 2})).json()
    assert body["usage"]["input_tokens"] == expected + 1
    assert body["instructions"] == "Be brief."
    # Without max_output_tokens the answer ends by itself ("completed") and the budget is the rest of the window.
    free = (await client.post("/v1/responses", json={"input": "Hi"})).json()
    assert free["status"] == "completed" and free["incomplete_details"] is None
    assert free["max_output_tokens"] == 8192 - free["usage"]["input_tokens"]


async def test_a_stream_is_vllms_event_sequence(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    resp = await client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 4, "stream": True})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = _events(resp.text)
    kinds = [kind for kind, _ in events]
    assert kinds == [*STREAM_EVENTS, *["response.output_text.delta"] * 4, *CLOSING_EVENTS]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    created, in_progress = events[0][1]["response"], events[1][1]["response"]
    assert created == in_progress and list(created) == RESPONSE_KEYS
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    added = events[2][1]
    assert list(added) == ["item", "output_index", "sequence_number", "type"]
    assert added["item"]["status"] == "in_progress" and added["item"]["content"] == []
    item_id = added["item"]["id"]
    assert events[3][1]["part"] == {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    deltas = [data for kind, data in events if kind == "response.output_text.delta"]
    assert list(deltas[0]) == ["content_index", "delta", "item_id", "logprobs", "output_index", "sequence_number",
                               "type"]
    assert all(d["item_id"] == item_id and d["logprobs"] == [] for d in deltas)
    text = "".join(d["delta"] for d in deltas)
    done = events[-4][1]
    assert list(done) == ["content_index", "item_id", "logprobs", "output_index", "sequence_number", "text", "type"]
    assert done["text"] == text
    assert events[-3][1]["part"]["text"] == text and events[-2][1]["item"]["status"] == "completed"
    final = events[-1][1]["response"]
    assert final["id"] == created["id"] and final["created_at"] == created["created_at"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"] == [events[-2][1]["item"]]
    assert final["usage"]["output_tokens"] == 4
    assert final["usage"]["total_tokens"] == final["usage"]["input_tokens"] + 4


async def test_logprobs_are_included_when_asked(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    request = {"input": "Hi", "max_output_tokens": 3, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    body = (await client.post("/v1/responses", json=request)).json()
    assert body["top_logprobs"] == 2
    logprobs = body["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == 3 and list(logprobs[0]) == ["token", "bytes", "logprob", "top_logprobs"]
    assert len(logprobs[0]["top_logprobs"]) == 2 and logprobs[0]["top_logprobs"][0]["token"] == logprobs[0]["token"]
    events = _events((await client.post("/v1/responses", json={**request, "stream": True})).text)
    delta = next(data for kind, data in events if kind == "response.output_text.delta")
    assert list(delta["logprobs"][0]) == ["token", "logprob", "top_logprobs"]
    assert list(delta["logprobs"][0]["top_logprobs"][0]) == ["token", "logprob"]
    assert len(events[-1][1]["response"]["output"][0]["content"][0]["logprobs"]) == 3


async def test_the_request_id_names_the_response_and_repeats_hit_the_cache(
        client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    request = {"input": "The same long question. " * 20, "max_output_tokens": 1, "request_id": "mine"}
    first = (await client.post("/v1/responses", json=request)).json()
    second = (await client.post("/v1/responses", json=request)).json()
    assert first["id"] == second["id"] == "mine"
    details = first["usage"]["input_tokens_details"], second["usage"]["input_tokens_details"]
    assert details[0]["cached_tokens"] == 0 and details[0]["cache_write_tokens"] > 0
    assert details[1]["cached_tokens"] == details[0]["cache_write_tokens"] and details[1]["cache_write_tokens"] == 0
    metrics = (await client.get("/metrics")).text
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0' in metrics


def _error(resp: Any) -> tuple[int, str, str | None, str]:
    error = resp.json()["error"]
    assert error["code"] == resp.status_code
    return resp.status_code, error["type"], error["param"], error["message"]


@pytest.mark.parametrize(("body", "expected"), [
    ({"model": "m"}, (400, "Bad Request", "body.input",
                      "1 validation error:\n  {'type': 'missing', 'loc': 'body.input', 'msg': 'Field required', "
                      "'input': '<dict of 2 items>'}")),
    ({"input": 3}, (400, "Bad Request", "body.input",
                    "2 validation errors:\n  {'type': 'string_type', 'loc': 'body.input', 'msg': 'Input should be "
                    "a valid string', 'input': '3'}\n  {'type': 'list_type', 'loc': 'body.input', 'msg': 'Input "
                    "should be a valid list', 'input': '3'}")),
    ({"input": "hi", "model": "x"}, (404, "NotFoundError", "model",
                                     "The model `x` does not exist. Valid aliases: m.")),
    ({"input": "hi", "previous_response_id": "resp_1"}, (404, "invalid_request_error", "response_id",
                                                         "Response with id 'resp_1' not found.")),
    ({"input": "hi", "background": True}, (400, "invalid_request_error", "background",
                                           "This vLLM engine does not support `store=True` and therefore does not "
                                           "support the background mode. To enable these features, set the "
                                           "environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching "
                                           "the vLLM server.")),
    ({"input": "hi", "background": True, "store": False}, (
        400, "BadRequestError", "background",
        "background can only be used when `store` is true (parameter=background)")),
    ({"input": "hi", "background": True, "store": False, "prompt": {"id": "p"}}, (
        400, "BadRequestError", "prompt", "prompt template is not supported (parameter=prompt)")),
    ({"input": "hi", "tool_choice": "required"}, (
        400, "BadRequestError", "tool_choice",
        "Tool choice 'required' must be specified with 'tools' parameter. (parameter=tool_choice)")),
    ({"input": "hi", "temperature": 5}, (400, "BadRequestError", "temperature",
                                         "temperature must be in [0, 2], got 5.0. (parameter=temperature, "
                                         "value=5.0)")),
    ({"input": "hi", "top_p": 0}, (400, "BadRequestError", "top_p",
                                   "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)")),
    ({"input": "hi", "max_output_tokens": 0}, (400, "BadRequestError", "max_tokens",
                                               "max_tokens must be at least 1, got 0. (parameter=max_tokens, "
                                               "value=0)")),
    ({"input": "hi", "max_output_tokens": 100000}, (
        400, "BadRequestError", "max_output_tokens",
        "max_output_tokens=100000 cannot be greater than max_model_len=8192. Please request fewer output tokens. "
        "(parameter=max_output_tokens, value=100000)")),
    ({"input": "hi", "stream": "maybe"}, (
        400, "Bad Request", "body.stream",
        "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'body.stream', 'msg': 'Input should be a valid "
        "boolean, unable to interpret input', 'input': 'maybe'}")),
    ({"input": "hi", "presence_penalty": 5}, (
        400, "Bad Request", "body.presence_penalty",
        "1 validation error:\n  {'type': 'less_than_equal', 'loc': 'body.presence_penalty', 'msg': 'Input should "
        "be less than or equal to 2', 'input': '5', 'ctx': {'le': 2.0}}")),
    ({"input": "hi", "metadata": {"a": 1}}, (
        400, "Bad Request", "body.metadata.a",
        "1 validation error:\n  {'type': 'string_type', 'loc': 'body.metadata.a', 'msg': 'Input should be a valid "
        "string', 'input': '1'}")),
    ({"input": "hi", "cache_salt": ""}, (
        400, "BadRequestError", "cache_salt",
        "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)")),
    ({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 25}, (
        400, "BadRequestError", "logprobs",
        "Requested sample logprobs of 25, which is greater than max allowed: 20 (parameter=logprobs, value=25)")),
    ({"input": []}, (400, "BadRequestError", None,
                     "Cannot apply chat template to an empty conversation. Provide at least one message.")),
    ({"input": [{"type": "web_search_call", "id": "w", "status": "completed"}]}, (
        400, "BadRequestError", "input", "Unsupported input item type: web_search_call (parameter=input)")),
    ({"input": "word " * 9000}, (
        400, "BadRequestError", "input_tokens",
        "This model's maximum context length is 8192 tokens. However, your prompt contains at least 8193 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=8193)")),
])
async def test_validation_errors_are_vllms(client: AsyncTestClient, body: dict[str, Any],  # type: ignore[type-arg]
                                           expected: tuple[int, str, str | None, str]) -> None:
    assert _error(await client.post("/v1/responses", json=body)) == expected


async def test_requests_that_are_not_json_or_not_posts(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    resp = await client.post("/v1/responses", content=b'{"input": "hi"}', headers={"content-type": "text/plain"})
    assert _error(resp) == (400, "Bad Request", None,
                            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed")
    resp = await client.post("/v1/responses", content=b"{", headers={"content-type": "application/json"})
    assert _error(resp)[:3] == (400, "Bad Request", "body.1")
    resp = await client.get("/v1/responses")
    assert resp.status_code == 405 and resp.json() == {"detail": "Method Not Allowed"}
    for resp in (await client.get("/v1/responses/resp_x"), await client.post("/v1/responses/resp_x/cancel")):
        assert _error(resp) == (404, "invalid_request_error", "response_id", "Response with id 'resp_x' not found.")
    state = (await client.get("/sim/state")).json()
    assert state["in_flight"] == 0 and state["steps"] == 0


async def test_rejections_and_unavailability_apply(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    await client.post("/sim/faults", json={"throttle_rate": 1})
    resp = await client.post("/v1/responses", json={"input": "hi"})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    await client.post("/sim/faults", json={"throttle_rate": 0, "mode": "unavailable"})
    assert (await client.post("/v1/responses", json={"input": "hi"})).status_code == 503
    await client.post("/sim/faults", json={"mode": "wrong_type"})
    resp = await client.post("/v1/responses", json={"input": "hi"})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    await client.post("/sim/faults", json={"mode": "none"})
    assert (await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1})).status_code == 200


@pytest.fixture
async def real_time() -> AsyncIterator[AsyncTestClient]:  # type: ignore[type-arg]
    """An engine on the wall clock (at a high time scale an answer is computed before it is shown)."""
    async with AsyncTestClient(app=create_engine_app(EngineConfig(served_model="m", port=1, seed=1))) as c:
        yield c


def _raw_post(client: AsyncTestClient, path: str, body: dict[str, Any]) -> tuple[bytes, bool]:  # type: ignore[type-arg]
    """POST straight to the ASGI app, in the test client's event loop as the client does: the bytes it sent, and
    whether it ended the response (the test client shows nothing of a response the app leaves unfinished)."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": msgspec.json.encode(body), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays until the app is done
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 1), "state": {}}
    client.blocking_portal.call(client.app, scope, receive, send)  # type: ignore[arg-type]
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    return b"".join(m.get("body", b"") for m in bodies), not bodies[-1].get("more_body", False)


@pytest.mark.parametrize("how", ["error", "close"])
async def test_an_aborted_stream_is_broken_off(real_time: AsyncTestClient, how: str) -> None:  # type: ignore[type-arg]
    """vLLM 0.32's Responses stream has no error event that validates: a failure drops the connection."""
    client = real_time
    await client.post("/sim/faults", json={"abort_rate": 1, "abort_with": how, "abort_after_tokens": 2})
    body, ended = _raw_post(client, "/v1/responses", {"input": "hi", "max_output_tokens": 10, "stream": True})
    assert not ended
    kinds = [kind for kind, _ in _events(body.decode())]
    assert kinds == [*STREAM_EVENTS, "response.output_text.delta", "response.output_text.delta"]
    state = (await client.get("/sim/state")).json()
    assert state["aborted"] == 1 and state["in_flight"] == 0 and state["kv_blocks_used"] == 0
    assert state["faulted"]["abort"] == 1
    # A full response is cut halfway through its body.
    body, ended = _raw_post(client, "/v1/responses", {"input": "hi", "max_output_tokens": 10})
    assert not ended and body.startswith(b'{"id":"resp_')


async def test_detokenize_round_trips_tokenize(client: AsyncTestClient) -> None:  # type: ignore[type-arg]
    text = "Hello world, here are 12345 words\n  and\tspaces! <|eot_id|> éàü"
    ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
    resp = await client.post("/detokenize", json={"model": "m", "tokens": ids})
    assert resp.status_code == 200 and resp.json() == {"prompt": "<|begin_of_text|>" + text}
    # Generated text decodes too; an id nothing produced decodes to nothing, as an unknown id does in vLLM.
    answer = (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "return_token_ids": True}))
    choice = answer.json()["choices"][0]
    ids = (await client.post("/tokenize", json={"prompt": choice["text"], "add_special_tokens": False})).json()
    assert (await client.post("/detokenize", json={"tokens": ids["tokens"]})).json() == {"prompt": choice["text"]}
    assert (await client.post("/detokenize", json={"tokens": [999_999, "7"]})).json() == {"prompt": ""}
    assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize(("body", "expected"), [
    ({}, (400, "Bad Request", "body.tokens", "1 validation error:\n  {'type': 'missing', 'loc': 'body.tokens', "
                                             "'msg': 'Field required', 'input': '<dict of 0 items>'}")),
    ({"tokens": "abc"}, (400, "Bad Request", "body.tokens",
                         "1 validation error:\n  {'type': 'list_type', 'loc': 'body.tokens', 'msg': 'Input should be "
                         "a valid list', 'input': 'abc'}")),
    ({"tokens": [-1, 1.5]}, (400, "Bad Request", "body.tokens.0",
                             "2 validation errors:\n  {'type': 'greater_than_equal', 'loc': 'body.tokens.0', 'msg': "
                             "'Input should be greater than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}\n  "
                             "{'type': 'int_from_float', 'loc': 'body.tokens.1', 'msg': 'Input should be a valid "
                             "integer, got a number with a fractional part', 'input': '1.5'}")),
    ({"model": "x", "tokens": [1]}, (404, "NotFoundError", "model",
                                     "The model `x` does not exist. Valid aliases: m.")),
])
async def test_detokenize_errors_are_vllms(client: AsyncTestClient, body: dict[str, Any],  # type: ignore[type-arg]
                                           expected: tuple[int, str, str | None, str]) -> None:
    assert _error(await client.post("/detokenize", json=body)) == expected


async def test_a_response_from_a_lora_adapter_carries_its_name() -> None:
    app = create_engine_app(EngineConfig(served_model="m", port=1, time_scale=1000, seed=1, enable_lora=True,
                                         lora_modules=(LoraModule("sql", "/lora/sql"),)))
    async with AsyncTestClient(app=app) as client:
        done = await client.post("/v1/responses", json={"model": "sql", "input": "hi", "max_output_tokens": 2})
        assert done.status_code == 200 and done.json()["model"] == "sql"
        streamed = _events((await client.post("/v1/responses", json={
            "model": "sql", "input": "hi", "max_output_tokens": 2, "stream": True})).text)
        assert {data["response"]["model"] for kind, data in streamed if "response" in data} == {"sql"}
        assert (await client.get("/sim/state")).json()["lora"]["gpu"] == ["sql"]
