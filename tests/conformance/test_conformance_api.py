"""The issue #32 endpoints, one suite against two targets: ``/v1/embeddings``, ``/detokenize``,
``/v1/responses`` and LoRA adapters (chat by adapter name, ``/v1/models``, ``vllm:lora_requests_info``,
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

As in ``test_conformance.py``: every test asserts what vLLM 0.32 does (recorded on the CPU tier's
servers; the facts are in ``deploy/vllm-cpu/README.md``) against the simulator in the default run and
against real vLLM in ``pytest -m vllm``, where it also sends the same requests to the simulator and
compares the two. ``embed_target`` is real vLLM's embedding server (``tiny-embed``, the tiny Llama as
a pooling model) or the simulator's ``tiny-llama`` engine; ``lora_target`` is ``tiny-llama`` serving
``tiny-lora-a`` with runtime loading allowed; ``/detokenize`` and ``/v1/responses`` use ``target``,
whose vLLM server runs without ``VLLM_ENABLE_RESPONSES_API_STORE`` (vLLM's default: nothing stored).
"""

from __future__ import annotations

import base64
import json
import math
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conformance.conftest import Target
from tests.conformance.observe import assert_shape, diff, metric_families, post_json, shape
from tests.conformance.test_conformance import CHAT_COMPLETION, EXACT, MESSAGES, MODEL_LIST, client

#: Deliberate differences between the simulator and vLLM in these tests, one line of reason each.
API_EXCEPTIONS: dict[str, str] = {
    "embedding_values": "Vectors differ (the sim hashes words into 384 dimensions, the tiny model pools 128); "
                        "sizes, unit length, determinism and the encodings are compared, not values.",
    "response_text": "Generated text differs, as for the other endpoints; only its type and how the stream "
                     "pieces add up are compared.",
}


def compare_on(target: Target, reference: Target, observe: Callable[[Target], Any], what: str) -> Any:
    """``observe(target)``; against real vLLM, also assert ``reference`` (a simulator) observes the same."""
    seen = observe(target)
    if target.is_vllm:
        problems = diff(seen, observe(reference))
        assert not problems, (f"{what}: the simulator differs from vLLM (first: vLLM, second: the simulator):\n  "
                              + "\n  ".join(problems))
    return seen


def error_of(resp: httpx.Response) -> tuple[int, str, str | None, int]:
    """(status, error type, param, code) of an OpenAI-style error answer."""
    assert resp.headers["content-type"] == "application/json", resp.text
    error = resp.json()["error"]
    return resp.status_code, error["type"], error["param"], error["code"]


# --- /v1/embeddings -------------------------------------------------------------------------

EMBEDDING_USAGE = {"prompt_tokens": "int", "total_tokens": "int", "completion_tokens": "int",
                   "prompt_tokens_details": "null", "completion_tokens_details": "null"}
EMBEDDING_LIST = {"id": "str", "object": "str", "created": "int", "model": "str",
                  "data": [{"index": "int", "object": "str", "embedding": ["float"]}], "usage": EMBEDDING_USAGE}
EMBEDDING_LIST_BASE64 = {**EMBEDDING_LIST, "data": [{"index": "int", "object": "str", "embedding": "str"}]}
#: The inputs an embeddings request takes: a string, strings, token ids, lists of token ids.
EMBED_INPUTS: dict[str, Any] = {
    "string": "hello world",
    "strings": ["hello world", "a quiet river"],
    "token ids": [5, 6, 7],
    "token id lists": [[5, 6, 7], [8, 9]],
}


def embed(t: Target, body: dict[str, Any]) -> httpx.Response:
    return post_json(f"{t.api}/embeddings", {"model": t.model, **body})


def prompt_tokens(t: Target, value: Any) -> int:
    """How many tokens ``value`` (an embeddings input) is: token ids counted, text as /tokenize counts it."""
    if isinstance(value, str):
        return int(post_json(f"{t.url}/tokenize", {"model": t.model, "prompt": value}).json()["count"])
    if value and all(isinstance(v, list) for v in value):
        return sum(len(v) for v in value)
    if all(isinstance(v, str) for v in value):
        return sum(prompt_tokens(t, v) for v in value)
    return len(value)


def from_base64(text: str) -> list[float]:
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def norm(vector: list[float]) -> float:
    return math.sqrt(math.fsum(x * x for x in vector))


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", list(EMBED_INPUTS))
def test_embeddings(embed_target: Target, sim: Target, kind: str) -> None:
    value = EMBED_INPUTS[kind]

    def observe(t: Target) -> Any:
        resp = embed(t, {"input": value})
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"] == "application/json"
        body = resp.json()
        assert body["object"] == "list" and body["id"].startswith("embd-") and body["model"] == t.model
        expected = len(value) if isinstance(value, list) and isinstance(value[0], str | list) else 1
        assert [d["index"] for d in body["data"]] == list(range(expected))
        assert {d["object"] for d in body["data"]} == {"embedding"}
        sizes = {len(d["embedding"]) for d in body["data"]}
        assert len(sizes) == 1, sizes
        assert all(abs(norm(d["embedding"]) - 1) < 1e-3 for d in body["data"])  # normalised
        usage = body["usage"]
        assert usage["prompt_tokens"] == prompt_tokens(t, value)  # a text's count includes the BOS token
        assert (usage["total_tokens"], usage["completion_tokens"]) == (usage["prompt_tokens"], 0)
        return shape(body)

    assert_shape(compare_on(embed_target, sim, observe, f"embeddings of {kind}"), EMBEDDING_LIST, kind)


def test_embeddings_of_token_ids_count_exactly(embed_target: Target, sim: Target) -> None:
    def observe(t: Target) -> int:
        return int(embed(t, {"input": EMBED_INPUTS["token id lists"]}).json()["usage"]["prompt_tokens"])

    assert compare_on(embed_target, sim, observe, "token-id prompt count") == 5


def test_embeddings_in_base64(embed_target: Target, sim: Target) -> None:
    """base64 is the float32 vector's little-endian bytes; the numbers are the float answer's."""

    def observe(t: Target) -> Any:
        floats = embed(t, {"input": ["hello world", "a quiet river"]}).json()
        encoded = embed(t, {"input": ["hello world", "a quiet river"], "encoding_format": "base64"})
        assert encoded.status_code == 200, encoded.text
        body = encoded.json()
        for mine, theirs in zip(body["data"], floats["data"], strict=True):
            assert close(from_base64(mine["embedding"]), theirs["embedding"])
        assert body["usage"] == floats["usage"]
        return shape(body)

    assert_shape(compare_on(embed_target, sim, observe, "base64 embeddings"), EMBEDDING_LIST_BASE64, "base64")


def test_embeddings_are_deterministic(embed_target: Target) -> None:
    first, again = (embed(embed_target, {"input": "the same words"}).json() for _ in range(2))
    assert close(first["data"][0]["embedding"], again["data"][0]["embedding"])


def test_embedding_dimensions(embed_target: Target, sim: Target) -> None:
    """``dimensions`` (a Matryoshka model: vLLM's server declares one): the first N of the model's
    output, normalised again; outside [1, size] the request is refused."""

    def observe(t: Target) -> Any:
        full = embed(t, {"input": "hello world"}).json()["data"][0]["embedding"]
        short = embed(t, {"input": "hello world", "dimensions": 32})
        assert short.status_code == 200, short.text
        vector = short.json()["data"][0]["embedding"]
        scale = norm(full[:32])
        assert close(vector, [x / scale for x in full[:32]], 1e-4)
        refused = [embed(t, {"input": "hello world", "dimensions": n}) for n in (0, len(full) + 1)]
        return shape(short.json()), [error_of(r) for r in refused]

    seen = compare_on(embed_target, sim, observe, "dimensions")
    assert seen[1] == [(400, "BadRequestError", None, 400)] * 2


#: (JSON body without the model) -> (status, error type, param); vLLM 0.32's embedding server's answers.
EMBED_ERRORS: dict[str, tuple[dict[str, Any], tuple[int, str, str | None]]] = {
    "missing input": ({}, (400, "Bad Request", "body.input")),
    "empty list": ({"input": []}, (400, "BadRequestError", None)),
    "empty token list": ({"input": [[]]}, (400, "BadRequestError", None)),
    "prompt over the window": ({"input": list(range(10, 600))}, (400, "BadRequestError", "input_tokens")),
    "token out of vocabulary": ({"input": [5, 200_000]}, (400, "BadRequestError", None)),
    "unknown encoding": ({"input": "x", "encoding_format": "bogus"}, (400, "Bad Request", "body.encoding_format")),
}
#: Cases whose message vLLM words as a pydantic union report (the sim reports the first failure only).
EMBED_OWN_WORDS = {"missing input", "unknown encoding"}


@pytest.mark.parametrize("case", list(EMBED_ERRORS))
def test_embedding_errors(embed_target: Target, sim: Target, case: str) -> None:
    body, expected = EMBED_ERRORS[case]

    def observe(t: Target) -> Any:
        resp = embed(t, body)
        assert error_of(resp) == (*expected, expected[0]), resp.text
        return None if case in EMBED_OWN_WORDS else resp.json()["error"]["message"]

    compare_on(embed_target, sim, observe, case)


def test_embeddings_of_an_unknown_model(embed_target: Target, sim: Target) -> None:
    """vLLM's pooling server names neither the served models nor the param (its generation server does both)."""

    def observe(t: Target) -> Any:
        resp = post_json(f"{t.api}/embeddings", {"model": "nope", "input": "x"})
        return error_of(resp), resp.json()["error"]["message"]

    assert compare_on(embed_target, sim, observe, "unknown model") == (
        (404, "NotFoundError", None, 404), "The model `nope` does not exist.")


# --- /detokenize ----------------------------------------------------------------------------


def test_detokenize_round_trip(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        bare = post_json(f"{t.url}/tokenize", {"model": t.model, "prompt": "hello world",
                                               "add_special_tokens": False}).json()["tokens"]
        with_bos = post_json(f"{t.url}/tokenize", {"model": t.model, "prompt": "hello world"}).json()["tokens"]
        chat = post_json(f"{t.url}/tokenize", {"model": t.model, "messages": MESSAGES}).json()["tokens"]
        token_lists: list[list[int]] = [bare, with_bos, chat, []]
        answers = [post_json(f"{t.url}/detokenize", {"model": t.model, "tokens": ids}) for ids in token_lists]
        answers.append(post_json(f"{t.url}/detokenize", {"tokens": bare}))  # the model is optional
        assert [r.status_code for r in answers] == [200] * 5, [r.text for r in answers]
        assert {r.headers["content-type"] for r in answers} == {"application/json"}
        prompts = [r.json()["prompt"] for r in answers]
        assert prompts[0] == prompts[4] == "hello world" and prompts[1] == "<|begin_of_text|>hello world"
        assert prompts[3] == ""
        return shape(answers[0].json()), prompts[2]  # the chat prompt as the template renders it

    seen = compare_on(target, sim, observe, "/detokenize")
    assert seen == ({"prompt": "str"}, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nSay something."
                                       "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_detokenize_errors(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        url = f"{t.url}/detokenize"
        unknown = post_json(url, {"model": "nope", "tokens": [1]})
        missing = post_json(url, {"model": t.model})
        negative = post_json(url, {"model": t.model, "tokens": [-1]})
        # vLLM drops ids outside the vocabulary without a word.
        outside = post_json(url, {"model": t.model, "tokens": [5, 200_000]})
        alone = post_json(url, {"model": t.model, "tokens": [5]})
        assert (outside.status_code, outside.json()) == (200, alone.json())
        assert [error_of(r) for r in (unknown, missing, negative)] == [
            (404, "NotFoundError", "model", 404), (400, "Bad Request", "body.tokens", 400),
            (400, "Bad Request", "body.tokens.0", 400)]
        return unknown.json()

    seen = compare_on(target, sim, observe, "/detokenize errors")
    assert seen["error"]["message"] == "The model `nope` does not exist. Valid aliases: tiny-llama."


# --- /v1/responses --------------------------------------------------------------------------

RESPONSE_USAGE = {
    "input_tokens": "int",
    "input_tokens_details": {"cached_tokens": "int", "cache_write_tokens": "int", "input_tokens_per_turn": [],
                             "cached_tokens_per_turn": []},
    "output_tokens": "int",
    "output_tokens_details": {"reasoning_tokens": "int", "tool_output_tokens": "int", "output_tokens_per_turn": [],
                              "tool_output_tokens_per_turn": []},
    "total_tokens": "int",
}
OUTPUT_TEXT = {"annotations": [], "text": "str", "type": "str", "logprobs": "null"}
OUTPUT_MESSAGE = {"id": "str", "content": [OUTPUT_TEXT], "role": "str", "status": "str", "type": "str",
                  "phase": "null"}
RESPONSE = {
    "id": "str", "created_at": "int", "incomplete_details": {"reason": "str"}, "instructions": "null",
    "metadata": "null", "model": "str", "object": "str", "output": [OUTPUT_MESSAGE], "parallel_tool_calls": "bool",
    "temperature": "float", "tool_choice": "str", "tools": [], "top_p": "float", "background": "bool",
    "max_output_tokens": "int", "max_tool_calls": "null", "previous_response_id": "null", "prompt": "null",
    "reasoning": "null", "service_tier": "str", "status": "str", "text": "null", "top_logprobs": "null",
    "truncation": "str", "usage": RESPONSE_USAGE, "user": "null", "presence_penalty": "float",
    "frequency_penalty": "float", "kv_transfer_params": "null", "ec_transfer_params": "null",
    "input_messages": "null", "output_messages": "null",
}
#: The response as ``response.created`` and ``response.in_progress`` carry it: nothing generated yet.
RESPONSE_STARTED = {**RESPONSE, "incomplete_details": "null", "output": [], "usage": "null"}
#: Every event of a streamed response that stops at ``max_output_tokens``, in order; ``*`` marks one or more.
RESPONSE_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                   "response.content_part.added", "response.output_text.delta*", "response.output_text.done",
                   "response.content_part.done", "response.output_item.done", "response.completed"]
EVENT_SHAPES: dict[str, Any] = {
    "response.created": {"response": RESPONSE_STARTED, "sequence_number": "int", "type": "str"},
    "response.in_progress": {"response": RESPONSE_STARTED, "sequence_number": "int", "type": "str"},
    "response.output_item.added": {"item": {**OUTPUT_MESSAGE, "content": []}, "output_index": "int",
                                   "sequence_number": "int", "type": "str"},
    "response.content_part.added": {"content_index": "int", "item_id": "str", "output_index": "int",
                                    "part": {**OUTPUT_TEXT, "logprobs": []}, "sequence_number": "int", "type": "str"},
    "response.output_text.delta": {"content_index": "int", "delta": "str", "item_id": "str", "logprobs": [],
                                   "output_index": "int", "sequence_number": "int", "type": "str"},
    "response.output_text.done": {"content_index": "int", "item_id": "str", "logprobs": [], "output_index": "int",
                                  "sequence_number": "int", "text": "str", "type": "str"},
    "response.content_part.done": {"content_index": "int", "item_id": "str", "output_index": "int",
                                   "part": OUTPUT_TEXT, "sequence_number": "int", "type": "str"},
    "response.output_item.done": {"item": OUTPUT_MESSAGE, "output_index": "int", "sequence_number": "int",
                                  "type": "str"},
    "response.completed": {"response": RESPONSE, "sequence_number": "int", "type": "str"},
}


def responses(t: Target, body: dict[str, Any]) -> httpx.Response:
    return post_json(f"{t.api}/responses", {"model": t.model, **body})


def test_response(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        resp = responses(t, {"input": "Say something.", "max_output_tokens": 5, **EXACT})
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"] == "application/json"
        body = resp.json()
        assert (body["object"], body["model"], body["status"]) == ("response", t.model, "incomplete")
        assert body["id"].startswith("resp_") and body["incomplete_details"] == {"reason": "max_output_tokens"}
        message = body["output"][0]
        assert (message["type"], message["role"], message["status"]) == ("message", "assistant", "completed")
        assert message["id"].startswith("msg_") and message["content"][0]["type"] == "output_text"
        usage = body["usage"]
        assert usage["output_tokens"] == 5 and usage["total_tokens"] == usage["input_tokens"] + 5
        # A string input is one user message; vLLM's responses path tokenizes the rendered chat prompt with
        # special tokens, so its BOS comes twice: one token more than the chat prompt of the same message.
        chat = post_json(f"{t.url}/tokenize", {"model": t.model, "messages": MESSAGES}).json()["count"]
        assert usage["input_tokens"] == chat + 1
        assert (body["max_output_tokens"], body["background"], body["tool_choice"], body["truncation"],
                body["service_tier"], body["temperature"], body["top_p"]) == (
            5, False, "none", "disabled", "auto", 1.0, 1.0)
        return shape(body)

    assert_shape(compare_on(target, sim, observe, "response"), RESPONSE, "response")


def test_response_that_stops(target: Target, sim: Target) -> None:
    """A stop string ends it: ``completed``, no incomplete details; message items and instructions taken."""

    def observe(t: Target) -> Any:
        resp = responses(t, {"input": [{"role": "user", "content": "Say something."}], "instructions": "Be brief.",
                             "max_output_tokens": 50, "stop": [" "], **EXACT})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["usage"]["output_tokens"] < 50
        return body["status"], body["incomplete_details"], body["instructions"], body["output"][0]["status"]

    assert compare_on(target, sim, observe, "stopped response") == ("completed", None, "Be brief.", "completed")


@dataclass(frozen=True)
class EventStream:
    """A streamed response: status, content type, and its (event name, data) pairs."""

    status: int
    content_type: str
    events: list[tuple[str, dict[str, Any]]]


def stream_response(t: Target, body: dict[str, Any]) -> EventStream:
    with httpx.stream("POST", f"{t.api}/responses", json={"model": t.model, **body, "stream": True},
                      timeout=120) as resp:
        text = resp.read().decode()
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block[:200]
        events.append((lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))))
    return EventStream(resp.status_code, resp.headers.get("content-type", ""), events)


def test_response_stream(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        got = stream_response(t, {"input": "Say something.", "max_output_tokens": 4, **EXACT})
        assert (got.status, got.content_type) == (200, "text/event-stream; charset=utf-8")
        names = [name for name, _ in got.events]
        assert all(name == data["type"] for name, data in got.events)  # no [DONE]: every event is typed
        assert [data["sequence_number"] for _, data in got.events] == list(range(len(got.events)))
        collapsed = [n for i, n in enumerate(names) if n != "response.output_text.delta" or names[i - 1] != n]
        assert collapsed == [n.rstrip("*") for n in RESPONSE_EVENTS]
        data = [d for _, d in got.events]
        first, last = data[0]["response"], data[-1]["response"]
        assert first["id"] == last["id"] and first["status"] == "in_progress"
        assert last["status"] == "incomplete" and last["usage"]["output_tokens"] == 4
        item = data[2]["item"]["id"]
        assert {d.get("item_id", item) for d in data[3:-2]} == {item} and last["output"][0]["id"] == item
        deltas = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
        assert deltas == data[-4]["text"] == last["output"][0]["content"][0]["text"]
        shapes: dict[str, Any] = {}
        for name, event in got.events:
            shapes.setdefault(name, shape(event))
        return shapes

    seen = compare_on(target, sim, observe, "response stream")
    for name, expected in EVENT_SHAPES.items():
        assert_shape(seen[name], expected, name)


def test_responses_are_not_stored(target: Target, sim: Target) -> None:
    """vLLM stores responses only with VLLM_ENABLE_RESPONSES_API_STORE=1 (off here, its default): a stored
    response cannot be read back nor continued, and background mode is refused."""

    def observe(t: Target) -> Any:
        made = responses(t, {"input": "hi", "max_output_tokens": 2, "store": True})
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        read = httpx.get(f"{t.api}/responses/{rid}", timeout=30)
        continued = responses(t, {"input": "more", "max_output_tokens": 2, "previous_response_id": rid})
        unknown = responses(t, {"input": "more", "max_output_tokens": 2, "previous_response_id": "resp_nope"})
        background = responses(t, {"input": "hi", "background": True})
        for resp, missing in ((read, rid), (continued, rid), (unknown, "resp_nope")):
            assert resp.json() == {"error": {"message": f"Response with id '{missing}' not found.",
                                             "type": "invalid_request_error", "param": "response_id", "code": 404}}
            assert resp.status_code == 404
        return error_of(background), background.json()["error"]["message"]

    assert compare_on(target, sim, observe, "store") == (
        (400, "invalid_request_error", "background", 400),
        "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
        "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
        "launching the vLLM server.")


#: (JSON body without the model) -> (status, error type, param); vLLM 0.32's answers.
RESPONSE_ERRORS: dict[str, tuple[dict[str, Any], tuple[int, str, str | None]]] = {
    "missing input": ({}, (400, "Bad Request", "body.input")),
    "max_output_tokens over the window": ({"input": "x", "max_output_tokens": 600},
                                          (400, "BadRequestError", "max_output_tokens")),
    "background without store": ({"input": "x", "background": True, "store": False},
                                 (400, "BadRequestError", "background")),
}


@pytest.mark.parametrize("case", list(RESPONSE_ERRORS))
def test_response_errors(target: Target, sim: Target, case: str) -> None:
    body, expected = RESPONSE_ERRORS[case]

    def observe(t: Target) -> str:
        resp = responses(t, body)
        assert error_of(resp) == (*expected, expected[0]), resp.text
        return str(resp.json()["error"]["message"])

    compare_on(target, sim, observe, case)


def test_response_of_an_unknown_model(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        resp = post_json(f"{t.api}/responses", {"model": "nope", "input": "x"})
        return error_of(resp), resp.json()["error"]["message"]

    assert compare_on(target, sim, observe, "unknown model") == (
        (404, "NotFoundError", "model", 404), "The model `nope` does not exist. Valid aliases: tiny-llama.")


# --- LoRA adapters --------------------------------------------------------------------------

MODEL_ENTRY: dict[str, Any] = cast("list[dict[str, Any]]", MODEL_LIST["data"])[0]
#: An adapter's ``/v1/models`` entry: its parent is the base model, its root the directory it was loaded from.
ADAPTER_ENTRY = {**MODEL_ENTRY, "parent": "str", "max_model_len": "null"}
LORA_INFO = "vllm:lora_requests_info"


def models(t: Target) -> list[dict[str, Any]]:
    resp = httpx.get(f"{t.api}/models", timeout=30)
    assert resp.status_code == 200
    return list(resp.json()["data"])


def test_adapter_in_the_model_list(lora_target: Target, lora_sim: Target) -> None:
    def observe(t: Target) -> Any:
        entries = models(t)
        (adapter, path), = t.adapters
        assert [m["id"] for m in entries] == [t.model, adapter]
        base, entry = entries
        assert (entry["root"], entry["parent"], entry["max_model_len"], entry["owned_by"], entry["object"]) == (
            path, t.model, None, "vllm", "model")
        assert base["parent"] is None and base["max_model_len"] == t.max_model_len
        return shape(base), shape(entry)

    base, entry = compare_on(lora_target, lora_sim, observe, "/v1/models with an adapter")
    assert_shape(base, MODEL_ENTRY, "the base model's entry")
    assert_shape(entry, ADAPTER_ENTRY, "the adapter's entry")


def test_chat_with_an_adapter(lora_target: Target, lora_sim: Target) -> None:
    (adapter, _), = lora_target.adapters

    def observe(t: Target) -> Any:
        resp = post_json(f"{t.api}/chat/completions",
                         {"model": adapter, "messages": MESSAGES, "max_tokens": 5, **EXACT})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["model"] == adapter and body["usage"]["completion_tokens"] == 5
        text = post_json(f"{t.api}/completions", {"model": adapter, "prompt": "hi", "max_tokens": 2, **EXACT})
        assert text.status_code == 200 and text.json()["model"] == adapter, text.text
        tokens = post_json(f"{t.url}/tokenize", {"model": adapter, "prompt": "hi"})
        assert tokens.status_code == 200, tokens.text
        return shape(body)

    assert_shape(compare_on(lora_target, lora_sim, observe, "chat with an adapter"), CHAT_COMPLETION, "adapter chat")
    sdk = client(lora_target).chat.completions.create(model=adapter, messages=MESSAGES,  # type: ignore[arg-type]
                                                      max_tokens=2, extra_body=EXACT)
    assert sdk.model == adapter and sdk.usage is not None and sdk.usage.completion_tokens == 2
    if lora_target.is_vllm:  # the adapter really changes the model: greedy outputs differ
        greedy = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, **EXACT}
        outputs = {m: post_json(f"{lora_target.api}/chat/completions", {**greedy, "model": m}).json()
                   ["choices"][0]["message"]["content"] for m in (lora_target.model, adapter)}
        assert outputs[lora_target.model] != outputs[adapter], outputs


def test_unknown_adapter(lora_target: Target, lora_sim: Target) -> None:
    def observe(t: Target) -> Any:
        resp = post_json(f"{t.api}/chat/completions", {"model": "tiny-lora-x", "messages": MESSAGES})
        return error_of(resp), resp.json()["error"]["message"]

    assert compare_on(lora_target, lora_sim, observe, "unknown adapter") == (
        (404, "NotFoundError", "model", 404), "The model `tiny-lora-x` does not exist. Valid aliases: tiny-llama.")


def lora_series(t: Target) -> list[tuple[dict[str, str], float]]:
    """The ``vllm:lora_requests_info`` samples: (labels, value), the value being when the set was last seen."""
    text = httpx.get(f"{t.url}/metrics", timeout=30).text
    return [(dict(s.labels), s.value) for f in text_string_to_metric_families(text) if f.name == LORA_INFO
            for s in f.samples]


def newest(series: list[tuple[dict[str, str], float]]) -> dict[str, str]:
    """The labels written last: the state now (every label set ever written stays exposed)."""
    assert series, f"no {LORA_INFO} sample"
    return max(series, key=lambda s: s[1])[0]


def test_lora_requests_info(lora_target: Target, lora_sim: Target) -> None:
    """One gauge, its labels the adapters with requests in flight (both labels list the same adapters in
    vLLM 0.32: the keys of one table); its value the Unix time the label set was last written."""
    (adapter, _), = lora_target.adapters

    def observe(t: Target) -> Any:
        family = metric_families(httpx.get(f"{t.url}/metrics", timeout=30).text).get(LORA_INFO)
        assert family is not None and family.type == "gauge"
        # Scrape all along a long request, from its start, on a thread of its own: a reader slowed down by a
        # busy machine must not see the engine only after it finished.
        polls: list[dict[str, str]] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                series = lora_series(t)
                if series:
                    polls.append(newest(series))
                time.sleep(0.02)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        during = None
        try:
            body = {"model": adapter, "prompt": "hello there", "max_tokens": 300, **EXACT}
            # A scrape may miss a whole request on a starved machine: up to three requests, until one is seen.
            for _ in range(3):
                with httpx.stream("POST", f"{t.api}/completions", json={**body, "stream": True},
                                  timeout=120) as resp:
                    assert resp.status_code == 200
                    for _ in resp.iter_lines():
                        pass
                time.sleep(0.2)
                during = next((p for p in polls if p["running_lora_adapters"]), None)
                if during is not None:
                    break
        finally:
            done.set()
            poller.join(timeout=30)
        time.sleep(0.5)
        after = lora_series(t)
        assert all(abs(value - time.time()) < 600 for _, value in after)
        assert {frozenset(labels) for labels, _ in after} == {
            frozenset({"max_lora", "running_lora_adapters", "waiting_lora_adapters"})}
        seen_during[t.name] = during
        return newest(after)

    # What a scrape sees while a request runs is compared only where one saw it: a real server on a starved
    # machine can finish three 300-token requests between two scrapes (the simulator, at twice real speed, cannot).
    seen_during: dict[str, dict[str, str] | None] = {}
    after = compare_on(lora_target, lora_sim, observe, LORA_INFO)
    running = {"max_lora": "1", "running_lora_adapters": adapter, "waiting_lora_adapters": adapter}
    assert seen_during["sim"] == running
    assert seen_during.get(lora_target.name) in (running, None)
    assert after == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}


def test_load_and_unload_an_adapter(lora_target: Target, lora_sim: Target) -> None:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (VLLM_ALLOW_RUNTIME_LORA_UPDATING): success is
    a plain-text sentence without a content type, errors are JSON."""
    assert lora_target.runtime_adapter is not None
    name, path = lora_target.runtime_adapter

    def answer(resp: httpx.Response) -> tuple[int, str | None, Any]:
        ctype = resp.headers.get("content-type")
        return resp.status_code, ctype, resp.json() if ctype == "application/json" else resp.text

    def observe(t: Target) -> Any:
        load, unload = f"{t.api}/load_lora_adapter", f"{t.api}/unload_lora_adapter"
        chat = {"model": name, "messages": MESSAGES, "max_tokens": 2, **EXACT}
        try:
            loaded = post_json(load, {"lora_name": name, "lora_path": path})
            twice = post_json(load, {"lora_name": name, "lora_path": path})
            # (The base model's root is its directory, which the simulator does not have: it names the model.)
            listed = [(m["id"], m["root"] if m["parent"] else "<base>", m["parent"]) for m in models(t)]
            served = post_json(f"{t.api}/chat/completions", chat)
            assert served.status_code == 200 and served.json()["model"] == name, served.text
        finally:
            unloaded = post_json(unload, {"lora_name": name})
        again = post_json(unload, {"lora_name": name})
        gone = post_json(f"{t.api}/chat/completions", chat)
        missing_dir = post_json(load, {"lora_name": "tiny-lora-x", "lora_path": f"{path}-nowhere"})
        no_path = post_json(load, {"lora_name": "tiny-lora-x"})
        assert error_of(no_path) == (400, "Bad Request", "body.lora_path", 400)
        assert [m["id"] for m in models(t)] == [t.model, *(a for a, _ in t.adapters)]
        return {"listed": listed, **{k: answer(r) for k, r in (
            ("loaded", loaded), ("twice", twice), ("unloaded", unloaded), ("again", again), ("gone", gone),
            ("missing_dir", missing_dir))}}

    seen = compare_on(lora_target, lora_sim, observe, "runtime adapters")
    (static, static_path), = lora_target.adapters
    assert seen == {
        "listed": [(lora_target.model, "<base>", None), (static, static_path, lora_target.model),
                   (name, path, lora_target.model)],
        "loaded": (200, None, f"Success: LoRA adapter '{name}' added successfully."),
        "twice": (400, "application/json", {"error": {
            "message": f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                       "place, set 'load_inplace' to True.", "type": "InvalidUserInput", "param": None, "code": 400}}),
        "unloaded": (200, None, f"Success: LoRA adapter '{name}' removed successfully."),
        "again": (404, "application/json", {"error": {
            "message": f"The lora adapter '{name}' cannot be found.", "type": "NotFoundError", "param": None,
            "code": 404}}),
        "gone": (404, "application/json", {"error": {
            "message": f"The model `{name}` does not exist. Valid aliases: tiny-llama.", "type": "NotFoundError",
            "param": "model", "code": 404}}),
        "missing_dir": (404, "application/json", {"error": {
            "message": "Loading lora tiny-lora-x failed: No adapter found for <path>", "type": "NotFoundError",
            "param": None, "code": 404}}),
    }
