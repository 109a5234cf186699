"""One suite, two targets: the simulator must look like vLLM 0.32 to a client and to a gateway.

Every test runs against ``switchyard sim`` (the default run) and against a real vLLM server
(``pytest -m vllm``). Each asserts concrete expectations that both must meet (status codes,
response and chunk shapes, error fields, metric families), and against real vLLM it also sends
the same request to the simulator and compares the two answers directly.

Structure is compared, not values: ``observe.shape`` keeps keys and replaces scalars by their
type. Where the simulator deliberately differs, the difference is listed in ``EXCEPTIONS`` and
the test says which entry it relies on. The real servers run with ``--enable-prompt-tokens-details``
(the simulator always reports cached tokens) and ``--scheduling-policy priority``.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from switchyard.engines.scrape import parse_engine_metrics
from tests.conformance.conftest import Target
from tests.conformance.observe import (
    Stream,
    assert_shape,
    diff,
    metric_families,
    post_json,
    post_raw,
    sample_value,
    shape,
    stream,
    without,
)

#: Deliberate differences between the simulator and vLLM, one line of reason each.
EXCEPTIONS: dict[str, str] = {
    "text": "Generated text differs (the sim writes filler words, the random-weight model writes noise); "
            "only its type is compared.",
    "tokenizer": "Prompt token counts of text differ (the sim's stand-in tokenizer is not the model's); "
                 "counts are compared only for token-id prompts.",
    "block_size": "KV block size differs (the sim's profile has vLLM's GPU default of 16, the CPU backend "
                  "uses 128), so cached-token counts differ; both must report whole blocks of a repeat.",
    "natural_stop": "Without max_tokens or ignore_eos the sim stops after a natural 16-256 tokens "
                    "(finish 'stop'); a random-weight model rarely samples EOS and runs to the context window.",
    "logprob_values": "Log-probabilities are made up (deterministic, the sampled token ranked first); "
                      "how many top entries a completion's dict holds can differ by one.",
    "validation_text": "A pydantic error listing several failures (union types: message parts, prompt "
                       "forms) is reported as its first failure only; type, param and code match.",
    "chat_parts": "Malformed chat content parts are refused with the sim's own message (vLLM quotes "
                  "pydantic's ValidatorIterator report); status, type and param match.",
    "process_metrics": "process_*, python_* and http_* families come from vLLM's process collectors and "
                       "its FastAPI instrumentator; many sim engines share one process, so it has none.",
    "info_values": "vllm:cache_config_info carries the sim's configuration (label names match, values "
                   "are the simulated engine's).",
    "multimodal": "The sim counts image parts as placeholder tokens; the tiny model is text-only "
                  "(vLLM: 'is not a multimodal model'), so images are not compared.",
    "tools": "Tool definitions are rendered into the prompt and never called; vLLM's answer depends on "
             "--enable-auto-tool-choice/--tool-call-parser, so tools are not compared.",
    "echo": "echo is accepted and ignored: the sim's token ids do not map back to prompt text.",
    "token_strs": "/tokenize answers token_strs null even when asked, for the same reason.",
    "stop_holdback": "A stop string spanning two tokens: vLLM holds back streamed text that may begin one, "
                     "the sim may already have streamed its first part (final text and stop_reason agree).",
    "kv_hashes": "KV event block hashes differ (vLLM's sha256 chain, the sim's own); both are unsigned 64-bit ints, "
                 "chained parent to child, and are compared only as names of blocks.",
    "kv_reset": "POST /reset_prefix_cache is always served by the sim; vLLM serves it only with "
                "VLLM_SERVER_DEV_MODE=1 (the vLLM tier's servers set it).",
    "kv_step_order": "Within one engine step the sim publishes evictions before stores (vLLM interleaves them "
                     "request by request), and drops batches when its publishing queue is full where vLLM blocks.",
    "endpoints": "The OpenAI completions, chat, embeddings and Responses API, /v1/models, /health, /ping, /version, "
                 "/load, /tokenize, /detokenize, /metrics and the LoRA load and unload endpoints are simulated; "
                 "/v1/messages, /invocations, the render and generate endpoints and the Responses API's store "
                 "(VLLM_ENABLE_RESPONSES_API_STORE) are not.",
}

MESSAGES = [{"role": "user", "content": "Say something."}]
EXACT = {"ignore_eos": True}


HEAD = {"id": "str", "object": "str", "created": "int", "model": "str"}
USAGE_COUNTS = {"prompt_tokens": "int", "total_tokens": "int", "completion_tokens": "int"}
CHAT_COMPLETION = {
    **HEAD,
    "choices": [{"index": "int",
                 "message": {"role": "str", "content": "str", "refusal": "null", "annotations": "null",
                             "audio": "null", "function_call": "null", "reasoning": "null"},
                 "logprobs": "null", "finish_reason": "str", "stop_reason": "null", "token_ids": "null",
                 "routed_experts": "null"}],
    "service_tier": "null", "system_fingerprint": "str",
    "usage": {**USAGE_COUNTS,
              "prompt_tokens_details": {"cached_tokens": "int", "created_cache_tokens": "int",
                                        "multimodal_tokens": "null"},
              "completion_tokens_details": "null"},
    "prompt_logprobs": "null", "prompt_token_ids": "null", "prompt_text": "null",
    "kv_transfer_params": "null", "ec_transfer_params": "null", "metrics": "null",
}
TEXT_COMPLETION = {
    **HEAD,
    "choices": [{"index": "int", "text": "str", "logprobs": "null", "finish_reason": "str",
                 "stop_reason": "null", "token_ids": "null", "prompt_logprobs": "null",
                 "prompt_token_ids": "null", "routed_experts": "null"}],
    "service_tier": "null", "system_fingerprint": "str",
    "usage": {**USAGE_COUNTS,
              "prompt_tokens_details": {"cached_tokens": "int", "created_cache_tokens": "null",
                                        "multimodal_tokens": "null"},
              "completion_tokens_details": "null"},
    "kv_transfer_params": "null", "ec_transfer_params": "null", "metrics": "null",
}
ROLE_CHUNK = {**HEAD, "choices": [{"index": "int", "delta": {"role": "str", "content": "str"},
                                   "logprobs": "null", "finish_reason": "null"}],
              "prompt_token_ids": "null", "prompt_text": "null"}
CHAT_CHUNK = {**HEAD, "choices": [{"index": "int", "delta": {"content": "str"}, "logprobs": "null",
                                   "finish_reason": "null", "token_ids": "null"}]}
CHAT_LAST_CHUNK = {**HEAD, "choices": [{"index": "int", "delta": {"content": "str"}, "logprobs": "null",
                                        "finish_reason": "str", "stop_reason": "null", "token_ids": "null"}]}
CHAT_USAGE_CHUNK = {**HEAD, "choices": [], "system_fingerprint": "str",
                    "usage": {**USAGE_COUNTS, "prompt_tokens_details": {"cached_tokens": "int",
                                                                        "created_cache_tokens": "int"}}}
TEXT_CHUNK = {**HEAD, "choices": [{"index": "int", "text": "str", "logprobs": "null", "finish_reason": "null",
                                   "stop_reason": "null", "prompt_token_ids": "null", "token_ids": "null"}]}
TEXT_LAST_CHUNK = {**HEAD, "choices": [{"index": "int", "text": "str", "logprobs": "null", "finish_reason": "str",
                                        "stop_reason": "null", "prompt_token_ids": "null", "token_ids": "null"}]}
TEXT_USAGE_CHUNK = {**HEAD, "choices": [], "system_fingerprint": "str",
                    "usage": {**USAGE_COUNTS, "prompt_tokens_details": {"cached_tokens": "int"}}}
ERROR = {"error": {"message": "str", "type": "str", "param": "str", "code": "int"}}
MODEL_LIST = {"object": "str", "data": [{
    "id": "str", "object": "str", "created": "int", "owned_by": "str", "root": "str", "parent": "null",
    "max_model_len": "int",
    "permission": [{"id": "str", "object": "str", "created": "int", "allow_create_engine": "bool",
                    "allow_sampling": "bool", "allow_logprobs": "bool", "allow_search_indices": "bool",
                    "allow_view": "bool", "allow_fine_tuning": "bool", "organization": "str",
                    "group": "null", "is_blocking": "bool"}]}]}


def compare(target: Target, sim: Target, observe: Callable[[Target], Any], what: str) -> Any:
    """``observe(target)``; against real vLLM, also assert the simulator observes the same."""
    seen = observe(target)
    if target.is_vllm:
        reference = observe(sim)
        problems = diff(seen, reference)
        assert not problems, (f"{what}: the simulator differs from vLLM (first: vLLM, second: the simulator):\n  "
                              + "\n  ".join(problems))
    return seen


def client(target: Target) -> openai.OpenAI:
    return openai.OpenAI(base_url=target.api, api_key="none", max_retries=0, timeout=120)


def fresh_ids(n: int) -> list[int]:
    """``n`` token ids no earlier request sent (ids valid for both vocabularies)."""
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(10, 1500) for _ in range(n)]


def fresh_text(words: int) -> str:
    """Text of about one token per word in both tokenizers, never sent before."""
    rng = random.Random(uuid.uuid4().int)
    vocab = ("the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "this", "be",
             "at", "by", "from", "or", "an", "we", "can")
    return " ".join(rng.choice(vocab) for _ in range(words))


# --- health and model list ------------------------------------------------------------------


def test_health(target: Target, sim: Target) -> None:
    def observe(t: Target) -> tuple[int, str, str | None]:
        resp = httpx.get(f"{t.url}/health", timeout=30)
        return resp.status_code, resp.text, resp.headers.get("content-type")

    assert compare(target, sim, observe, "/health") == (200, "", None)


def test_model_list(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        resp = httpx.get(f"{t.api}/models", timeout=30)
        assert resp.status_code == 200
        body = resp.json()
        assert [m["id"] for m in body["data"]] == [t.model]
        assert body["data"][0]["max_model_len"] == t.max_model_len
        assert (body["object"], body["data"][0]["object"], body["data"][0]["owned_by"]) == ("list", "model", "vllm")
        return shape(body)

    assert_shape(compare(target, sim, observe, "/v1/models"), MODEL_LIST, "/v1/models")
    sdk = client(target).models.list().data
    assert [m.id for m in sdk] == [target.model]


def test_utility_endpoints(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        version = httpx.get(f"{t.url}/version", timeout=30)
        pings = [httpx.get(f"{t.url}/ping", timeout=30), httpx.post(f"{t.url}/ping", timeout=30)]
        load = httpx.get(f"{t.url}/load", timeout=30)
        assert version.json() == {"version": "0.32.0"}
        assert [(p.status_code, p.text) for p in pings] == [(200, ""), (200, "")]
        return shape(version.json()), shape(load.json())

    assert compare(target, sim, observe, "/version, /ping, /load") == ({"version": "str"}, {"server_load": "int"})


def test_tokenize(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        text = post_json(f"{t.url}/tokenize", {"model": t.model, "prompt": "hello world"})
        bare = post_json(f"{t.url}/tokenize", {"prompt": "hello world", "add_special_tokens": False})
        chat = post_json(f"{t.url}/tokenize", {"model": t.model, "messages": MESSAGES})
        unknown = post_json(f"{t.url}/tokenize", {"model": "nope", "prompt": "x"})
        bodies = [r.json() for r in (text, bare, chat)]
        assert [r.status_code for r in (text, bare, chat, unknown)] == [200, 200, 200, 404]
        assert all(b["count"] == len(b["tokens"]) and b["max_model_len"] == t.max_model_len for b in bodies)
        assert bodies[0]["count"] == bodies[1]["count"] + 1  # the BOS token
        return [shape(b) for b in bodies], shape(unknown.json())

    seen = compare(target, sim, observe, "/tokenize")
    assert seen[0][0] == {"count": "int", "max_model_len": "int", "tokens": ["int"], "token_strs": "null"}


# --- full responses -------------------------------------------------------------------------


def test_chat_completion(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        resp = post_json(f"{t.api}/chat/completions",
                         {"model": t.model, "messages": MESSAGES, "max_tokens": 5, **EXACT})
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"] == "application/json"
        body = resp.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        choice = body["choices"][0]
        assert (choice["finish_reason"], choice["message"]["role"]) == ("length", "assistant")
        assert body["usage"]["completion_tokens"] == 5
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5
        return shape(body)

    assert_shape(compare(target, sim, observe, "chat.completion"), CHAT_COMPLETION, "chat.completion")
    # The SDK's view: typed fields, cached tokens where OpenAI puts them.
    resp = client(target).chat.completions.create(model=target.model, messages=MESSAGES,  # type: ignore[arg-type]
                                                  max_tokens=3, extra_body=EXACT)
    assert resp.choices[0].finish_reason == "length" and isinstance(resp.choices[0].message.content, str)
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    assert resp.usage.prompt_tokens_details is not None
    assert isinstance(resp.usage.prompt_tokens_details.cached_tokens, int)
    assert isinstance(resp.system_fingerprint, str) and resp.system_fingerprint.startswith("vllm-0.32.0-")


def test_text_completion_with_two_prompts_and_two_samples(target: Target, sim: Target) -> None:
    prompts = [fresh_ids(6), fresh_ids(9)]

    def observe(t: Target) -> Any:
        resp = post_json(f"{t.api}/completions",
                         {"model": t.model, "prompt": prompts, "n": 2, "max_tokens": 3, **EXACT})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
        assert {c["finish_reason"] for c in body["choices"]} == {"length"}
        # Each prompt counted once whatever n; every sample's tokens counted.
        assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (15, 12)
        return shape(body)

    assert_shape(compare(target, sim, observe, "text_completion"), TEXT_COMPLETION, "text_completion")
    sdk = client(target).completions.create(model=target.model, prompt="Once upon", max_tokens=4, extra_body=EXACT)
    assert sdk.usage is not None and sdk.usage.completion_tokens == 4 and isinstance(sdk.choices[0].text, str)


@pytest.mark.parametrize("streamed", [False, True], ids=["full", "stream"])
def test_chat_with_two_samples(target: Target, sim: Target, streamed: bool) -> None:
    body = {"messages": MESSAGES, "n": 2, "max_tokens": 3, **EXACT}

    def observe(t: Target) -> Any:
        url = f"{t.api}/chat/completions"
        if not streamed:
            resp = post_json(url, {**body, "model": t.model})
            assert resp.status_code == 200, resp.text
            full = resp.json()
            assert sorted(c["index"] for c in full["choices"]) == [0, 1]
            assert full["usage"]["completion_tokens"] == 6
            return shape(full)
        events = stream(url, {**body, "model": t.model, "stream_options": {"include_usage": True}})
        roles = [c["choices"][0]["index"] for c in events.choice_chunks() if "role" in c["choices"][0]["delta"]]
        finished = sorted(c["choices"][0]["index"] for c in events.choice_chunks()
                          if c["choices"][0]["finish_reason"] is not None)
        assert sorted(roles) == [0, 1] and finished == [0, 1]
        assert events.usage_chunk is not None and events.usage_chunk["usage"]["completion_tokens"] == 6
        return sorted({repr(shape(c)) for c in events.chunks})

    seen = compare(target, sim, observe, "chat with n=2")
    if not streamed:
        assert_shape(seen, CHAT_COMPLETION, "chat.completion with n=2")


def test_request_id_header_names_the_response(target: Target, sim: Target) -> None:
    def observe(t: Target) -> str:
        resp = httpx.post(f"{t.api}/completions", headers={"X-Request-Id": "conformance-42"}, timeout=60,
                          json={"model": t.model, "prompt": "hi", "max_tokens": 1})
        assert resp.status_code == 200
        return str(resp.json()["id"])

    assert compare(target, sim, observe, "id from X-Request-Id") == "cmpl-conformance-42"


def test_output_budget_is_cut_to_the_context_window(target: Target, sim: Target) -> None:
    prompt = fresh_ids(500)

    def observe(t: Target) -> tuple[int, str, int, str]:
        capped = post_json(f"{t.api}/completions", {"model": t.model, "prompt": prompt, "max_tokens": 100, **EXACT})
        endless = post_json(f"{t.api}/completions", {"model": t.model, "prompt": prompt, **EXACT})
        assert capped.status_code == 200 and endless.status_code == 200, (capped.text, endless.text)
        a, b = capped.json(), endless.json()
        return (a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"],
                b["usage"]["completion_tokens"], b["choices"][0]["finish_reason"])

    assert compare(target, sim, observe, "output budget") == (12, "length", 12, "length")


@pytest.mark.parametrize("streamed", [False, True], ids=["full", "stream"])
def test_a_stop_string_ends_the_output(target: Target, sim: Target, streamed: bool) -> None:
    """Noise and filler text alike contain a space within a few tokens."""
    body = {"prompt": fresh_ids(5), "max_tokens": 50, "stop": [" "], **EXACT}

    def observe(t: Target) -> Any:
        url = f"{t.api}/completions"
        if streamed:
            events = stream(url, {**body, "model": t.model, "stream_options": {"include_usage": True}})
            chunks = events.choice_chunks()
            last, text = chunks[-1]["choices"][0], "".join(c["choices"][0]["text"] for c in chunks)
            assert events.usage_chunk is not None
            tokens = events.usage_chunk["usage"]["completion_tokens"]
            found = shape(chunks[-1])
        else:
            resp = post_json(url, {**body, "model": t.model})
            assert resp.status_code == 200, resp.text
            full = resp.json()
            last, text, tokens = full["choices"][0], full["choices"][0]["text"], full["usage"]["completion_tokens"]
            found = shape(full)
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", " ")
        assert " " not in text and 1 <= tokens < 50
        return found

    seen = compare(target, sim, observe, "stop string")
    if not streamed:
        choice = {**TEXT_COMPLETION["choices"][0], "stop_reason": "str"}  # type: ignore[index]
        assert_shape(seen, {**TEXT_COMPLETION, "choices": [choice]}, "a stopped completion")


def test_answer_role_without_generation_prompt(target: Target, sim: Target) -> None:
    def observe(t: Target) -> str:
        resp = post_json(f"{t.api}/chat/completions", {"model": t.model, "messages": MESSAGES, "max_tokens": 1,
                                                       "add_generation_prompt": False})
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["message"]["role"])

    assert compare(target, sim, observe, "role") == "user"


STORY = [*MESSAGES, {"role": "assistant", "content": "Once upon a"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_continue_final_message(target: Target, sim: Target) -> None:
    """The final message is left open (no end of turn, no generation prompt); the answer's role is its role."""

    def observe(t: Target) -> Any:
        body = {"model": t.model, "messages": STORY, "max_tokens": 3, **CONTINUE, **EXACT}
        full = post_json(f"{t.api}/chat/completions", body)
        assert full.status_code == 200, full.text
        answer = full.json()
        events = stream(f"{t.api}/chat/completions", body)
        assert events.done
        count = post_json(f"{t.url}/tokenize", {"model": t.model, "messages": STORY, **CONTINUE}).json()["count"]
        closed = post_json(f"{t.url}/tokenize", {"model": t.model, "messages": STORY,
                                                 "add_generation_prompt": False}).json()["count"]
        assert answer["usage"]["prompt_tokens"] == count  # the prompt as rendered
        return {"role": answer["choices"][0]["message"]["role"],
                "stream_role": events.choice_chunks()[0]["choices"][0]["delta"],
                "end_of_turn_tokens": closed - count, "completion_tokens": answer["usage"]["completion_tokens"],
                "shape": shape(answer)}

    seen = compare(target, sim, observe, "continue_final_message")
    assert {k: v for k, v in seen.items() if k != "shape"} == {
        "role": "assistant", "stream_role": {"role": "assistant", "content": ""}, "end_of_turn_tokens": 1,
        "completion_tokens": 3}
    assert_shape(seen["shape"], CHAT_COMPLETION, "a continued chat.completion")


def test_priority_is_accepted(target: Target, sim: Target) -> None:
    def observe(t: Target) -> int:
        body = {"model": t.model, "prompt": "hi", "max_tokens": 1, "priority": -5}
        return post_json(f"{t.api}/completions", body).status_code

    assert compare(target, sim, observe, "priority") == 200


# --- streams --------------------------------------------------------------------------------


def _stream_shapes(events: Stream, middle: Any, usage: bool) -> dict[str, Any]:
    """Shapes of a stream's first, last (with ``finish_reason``) and usage chunks; every chunk in
    between must have the ``middle`` shape. (A reader that falls behind may get several tokens in
    one chunk, so how many middle chunks there are is not compared.)"""
    assert events.status == 200
    assert events.content_type == "text/event-stream; charset=utf-8"
    assert events.done, "the stream must end with data: [DONE]"
    chunks = events.choice_chunks()
    out = {"first": shape(chunks[0]), "last": shape(chunks[-1])}
    for chunk in chunks[1:-1]:
        assert_shape(shape(chunk), middle, "a chunk in mid-stream")
    if usage:
        assert events.usage_chunk is not None
        out["usage"] = shape(events.usage_chunk)
    else:
        assert events.usage_chunk is None
    return out


@pytest.mark.parametrize("usage", [True, False], ids=["include_usage", "no_usage"])
def test_chat_stream(target: Target, sim: Target, usage: bool) -> None:
    body: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 4, **EXACT}
    if usage:
        body["stream_options"] = {"include_usage": True}

    def observe(t: Target) -> Any:
        events = stream(f"{t.api}/chat/completions", {**body, "model": t.model})
        chunks = events.choice_chunks()
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        tokens = chunks[1:]
        assert 1 <= len(tokens) <= 4  # one chunk per token, unless a slow reader lets them pile up
        assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * (len(tokens) - 1) + ["length"]
        if usage:
            assert events.usage_chunk is not None and events.usage_chunk["usage"]["completion_tokens"] == 4
        shapes = _stream_shapes(events, CHAT_CHUNK, usage)
        shapes.pop("first")
        return {"role": shape(chunks[0]), **shapes}

    seen = compare(target, sim, observe, "chat stream")
    assert_shape(seen["role"], ROLE_CHUNK, "the role chunk")
    # Without a usage chunk to close the stream, the last token's chunk carries the fingerprint.
    assert_shape(seen["last"], CHAT_LAST_CHUNK if usage else {**CHAT_LAST_CHUNK, "system_fingerprint": "str"},
                 "the last chunk")
    if usage:
        assert_shape(seen["usage"], CHAT_USAGE_CHUNK, "the usage chunk")


@pytest.mark.parametrize("usage", [True, False], ids=["include_usage", "no_usage"])
def test_completion_stream(target: Target, sim: Target, usage: bool) -> None:
    body: dict[str, Any] = {"prompt": fresh_ids(5), "max_tokens": 4, **EXACT}
    if usage:
        body["stream_options"] = {"include_usage": True}

    def observe(t: Target) -> Any:
        events = stream(f"{t.api}/completions", {**body, "model": t.model})
        tokens = events.choice_chunks()
        assert 1 <= len(tokens) <= 4
        assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * (len(tokens) - 1) + ["length"]
        if usage:
            assert events.usage_chunk is not None
            counts = events.usage_chunk["usage"]
            assert (counts["prompt_tokens"], counts["completion_tokens"]) == (5, 4)
        shapes = _stream_shapes(events, TEXT_CHUNK, usage)
        if len(tokens) > 1:
            assert_shape(shapes.pop("first"), TEXT_CHUNK, "the first chunk")
        else:
            shapes.pop("first")
        return shapes

    seen = compare(target, sim, observe, "completion stream")
    assert_shape(seen["last"], TEXT_LAST_CHUNK if usage else {**TEXT_LAST_CHUNK, "system_fingerprint": "str"},
                 "the last chunk")
    if usage:
        assert_shape(seen["usage"], TEXT_USAGE_CHUNK, "the usage chunk")


def test_sdk_streams(target: Target) -> None:
    c = client(target)
    chunks = list(c.chat.completions.create(model=target.model, messages=MESSAGES, max_tokens=4,  # type: ignore[arg-type]
                                            stream=True, stream_options={"include_usage": True}, extra_body=EXACT))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens_details is not None
    text = list(c.completions.create(model=target.model, prompt="Once", max_tokens=3, stream=True, extra_body=EXACT))
    assert text[-1].choices[0].finish_reason == "length" and all(isinstance(t.choices[0].text, str) for t in text)


async def test_stream_as_the_gateway_reads_it(target: Target, sim: Target) -> None:
    """aiohttp, the gateway's upstream client, reading line by line: SSE framing and headers."""

    async def observe(t: Target) -> tuple[int, str, bytes]:
        body = {"model": t.model, "prompt": "hi", "max_tokens": 3, "stream": True, **EXACT}
        async with aiohttp.ClientSession() as session, session.post(f"{t.api}/completions", json=body) as resp:
            lines = [line async for line in resp.content]
        events = lines[0::2]
        assert all(line.startswith(b"data: ") and line.endswith(b"\n") for line in events)
        assert all(line == b"\n" for line in lines[1::2]), "every event is followed by one blank line"
        return resp.status, resp.headers["Content-Type"], events[-1]

    seen = await observe(target)
    assert seen == (200, "text/event-stream; charset=utf-8", b"data: [DONE]\n")
    if target.is_vllm:
        assert await observe(sim) == seen


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_continuous_usage_in_every_chunk(target: Target, sim: Target, chat: bool) -> None:
    path = "chat/completions" if chat else "completions"
    body: dict[str, Any] = {"max_tokens": 3, "stream_options": {"include_usage": True,
                                                                "continuous_usage_stats": True}, **EXACT}
    body |= {"messages": MESSAGES} if chat else {"prompt": fresh_ids(4)}

    def observe(t: Target) -> Any:
        events = stream(f"{t.api}/{path}", {**body, "model": t.model})
        chunks = events.choice_chunks()
        assert all("usage" in c for c in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == 3
        return _stream_shapes(events, middle, usage=True)

    # Chat's running usage names completion_tokens_details (null); a text completion's does not.
    running = {**USAGE_COUNTS, "completion_tokens_details": "null"} if chat else USAGE_COUNTS
    middle = {**(CHAT_CHUNK if chat else TEXT_CHUNK), "usage": running}
    seen = compare(target, sim, observe, "continuous usage stream")
    first = {**ROLE_CHUNK, "usage": running} if chat else middle
    assert_shape(seen["first"], first, "the first chunk")
    assert_shape(seen["usage"], CHAT_USAGE_CHUNK if chat else TEXT_USAGE_CHUNK, "the usage chunk")


@pytest.mark.parametrize("mode", ["chat", "chat_stream", "completion", "completion_stream"])
def test_logprobs(target: Target, sim: Target, mode: str) -> None:
    chat = mode.startswith("chat")
    body: dict[str, Any] = {"max_tokens": 2, **EXACT}
    body |= {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2} if chat else {"prompt": "hi", "logprobs": 2}

    def normalise(logprobs: Any) -> Any:
        if chat:
            # A token that ends inside a UTF-8 character has no bytes of its own: an empty list.
            for entry in logprobs["content"]:
                for item in (entry, *entry["top_logprobs"]):
                    item["bytes"] = item["bytes"] or [0]
        else:
            # A completion's top entries are keyed by token text (see EXCEPTIONS["logprob_values"]).
            logprobs = {**logprobs, "top_logprobs": [{"<token>": next(iter(d.values()))}
                                                     for d in logprobs["top_logprobs"]]}
        return shape(logprobs)

    def observe(t: Target) -> Any:
        url = f"{t.api}/{'chat/completions' if chat else 'completions'}"
        if mode.endswith("stream"):
            events = stream(url, {**body, "model": t.model})
            assert events.done
            found = [normalise(c["choices"][0]["logprobs"]) for c in events.choice_chunks()
                     if c["choices"][0].get("logprobs") is not None]
            assert found, "no chunk carried logprobs"
            return found[0]
        resp = post_json(url, {**body, "model": t.model})
        assert resp.status_code == 200, resp.text
        return normalise(resp.json()["choices"][0]["logprobs"])

    seen = compare(target, sim, observe, f"logprobs ({mode})")
    if chat:
        entry = {"token": "str", "logprob": "float", "bytes": ["int"]}
        assert_shape(seen, {"content": [{**entry, "top_logprobs": [entry]}]}, "chat logprobs")
    else:
        assert_shape(seen, {"text_offset": ["int"], "token_logprobs": ["float"], "tokens": ["str"],
                            "top_logprobs": [{"<token>": "float"}]}, "completion logprobs")


def test_a_client_that_goes_away_aborts_its_request(target: Target, sim: Target) -> None:
    """The request stops (KV freed) and is not counted as a finished request of any kind."""
    outcomes = ("abort", "length", "stop")

    def observe(t: Target) -> Any:
        def read() -> dict[str, float]:
            text = httpx.get(f"{t.url}/metrics", timeout=30).text
            counts = {r: sample_value(text, "vllm:request_success_total", finished_reason=r) for r in outcomes}
            return {**counts, "running": sample_value(text, "vllm:num_requests_running"),
                    "e2e": sample_value(text, "vllm:e2e_request_latency_seconds_count")}

        before = read()
        body = {"model": t.model, "prompt": fresh_ids(5), "max_tokens": 500, "stream": True, **EXACT}
        with httpx.stream("POST", f"{t.api}/completions", json=body, timeout=60) as resp:
            assert next(resp.iter_lines()).startswith("data: ")
        for _ in range(100):
            after = read()
            if after["running"] == 0:
                break
            time.sleep(0.1)
        time.sleep(0.5)  # anything the abort would count has been published by now
        after = read()
        return {k: after[k] - before[k] for k in before if k != "running"} | {"running": after["running"]}

    assert compare(target, sim, observe, "client disconnect") == {
        "abort": 0, "length": 0, "stop": 0, "e2e": 0, "running": 0}


# --- the prefix cache as a client sees it ---------------------------------------------------


def test_cached_tokens_rise_on_a_repeated_prompt(target: Target) -> None:
    """Both must report whole cached blocks of a >=256-token repeat (EXCEPTIONS["block_size"])."""
    ids = fresh_ids(300)
    first = post_json(f"{target.api}/completions", {"model": target.model, "prompt": ids, "max_tokens": 1})
    second = post_json(f"{target.api}/completions", {"model": target.model, "prompt": ids, "max_tokens": 1})
    a, b = (r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second))
    assert a == 0 and 256 <= b < 300

    messages = [{"role": "user", "content": fresh_text(300)}]
    chats = [post_json(f"{target.api}/chat/completions", {"model": target.model, "messages": messages,
                                                          "max_tokens": 1}).json() for _ in range(2)]
    details = [c["usage"]["prompt_tokens_details"] for c in chats]
    prompt = chats[0]["usage"]["prompt_tokens"]
    assert 256 <= prompt < 512
    assert details[0]["cached_tokens"] == 0 and details[0]["created_cache_tokens"] >= 256
    assert details[1]["cached_tokens"] >= 256 and details[1]["created_cache_tokens"] == 0
    sdk = client(target).chat.completions.create(model=target.model, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert sdk.usage is not None and sdk.usage.prompt_tokens_details is not None
    assert (sdk.usage.prompt_tokens_details.cached_tokens or 0) >= 256


# --- errors ---------------------------------------------------------------------------------

C, CH = "completions", "chat/completions"
#: (path, JSON body or raw bytes) -> (status, error type, param); vLLM 0.32's answers.
ERROR_CASES: dict[str, tuple[str, Any, tuple[int, str, str | None]]] = {
    "unknown model": (CH, {"model": "nope", "messages": MESSAGES}, (404, "NotFoundError", "model")),
    "unknown model wins over sampling": (CH, {"model": "nope", "messages": MESSAGES, "temperature": 5},
                                         (404, "NotFoundError", "model")),
    "field types win over the model": (CH, {"model": "nope", "messages": MESSAGES, "max_tokens": "x"},
                                       (400, "Bad Request", "body.max_tokens")),
    "max_tokens zero": (CH, {"messages": MESSAGES, "max_tokens": 0}, (400, "BadRequestError", "max_tokens")),
    "max_tokens negative": (C, {"prompt": "hi", "max_tokens": -1}, (400, "BadRequestError", "max_tokens")),
    "max_tokens fractional": (C, {"prompt": "hi", "max_tokens": 2.5}, (400, "Bad Request", "body.max_tokens")),
    "max_tokens over the window": (CH, {"messages": MESSAGES, "max_tokens": 600},
                                   (400, "BadRequestError", "max_tokens")),
    "max_completion_tokens over the window": (CH, {"messages": MESSAGES, "max_completion_tokens": 600},
                                              (400, "BadRequestError", "max_completion_tokens")),
    "prompt over the window": (C, {"prompt": list(range(10, 610)), "max_tokens": 1},
                               (400, "BadRequestError", "input_tokens")),
    "prompt fills the window": (C, {"prompt": list(range(10, 522))}, (400, "BadRequestError", "max_tokens")),
    "chat over the window": (CH, {"messages": [{"role": "user", "content": "the " * 600}]},
                             (400, "BadRequestError", "input_tokens")),
    "temperature negative": (CH, {"messages": MESSAGES, "temperature": -1}, (400, "BadRequestError", "temperature")),
    "temperature over 2": (CH, {"messages": MESSAGES, "temperature": 3}, (400, "BadRequestError", "temperature")),
    "temperature before max_tokens": (CH, {"messages": MESSAGES, "max_tokens": -1, "temperature": 5},
                                      (400, "BadRequestError", "temperature")),
    "top_p zero": (CH, {"messages": MESSAGES, "top_p": 0}, (400, "BadRequestError", "top_p")),
    "n zero": (C, {"prompt": "hi", "n": 0}, (400, "BadRequestError", None)),
    "min_tokens over max_tokens": (C, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
                                   (400, "BadRequestError", None)),
    "stream_options without stream": (CH, {"messages": MESSAGES, "stream_options": {"include_usage": True}},
                                      (400, "BadRequestError", "stream_options")),
    "empty stop string": (C, {"prompt": "hi", "stop": ["x", ""]}, (400, "BadRequestError", None)),
    "empty cache_salt": (C, {"prompt": "hi", "cache_salt": ""}, (400, "BadRequestError", "cache_salt")),
    "logprobs over 20": (C, {"prompt": "hi", "logprobs": 30}, (400, "BadRequestError", "logprobs")),
    "top_logprobs without logprobs": (CH, {"messages": MESSAGES, "top_logprobs": 2},
                                      (400, "BadRequestError", "top_logprobs")),
    "stream not a boolean": (C, {"prompt": "hi", "stream": "x"}, (400, "Bad Request", "body.stream")),
    "stop not a string": (C, {"prompt": "hi", "stop": 5}, (400, "Bad Request", "body.stop")),
    "user not a string": (C, {"prompt": "hi", "user": 5}, (400, "Bad Request", "body.user")),
    "model not a string": (CH, {"model": 5, "messages": MESSAGES}, (400, "Bad Request", "body.model")),
    "missing messages": (CH, {"max_tokens": 2}, (400, "Bad Request", "body.messages")),
    "messages not a list": (CH, {"messages": "hi"}, (400, "Bad Request", "body.messages")),
    "empty messages": (CH, {"messages": []}, (400, "BadRequestError", None)),
    "message without a role": (CH, {"messages": [{"content": "x"}]},
                               (400, "Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam.role")),
    "message content a number": (CH, {"messages": [{"role": "user", "content": 5}]},
                                 (400, "Bad Request", "body.messages.0.ChatCompletionDeveloperMessageParam.content")),
    "unknown content part": (CH, {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
                             (400, "BadRequestError", None)),
    "missing prompt": (C, {"max_tokens": 2}, (400, "BadRequestError", "prompt")),
    "empty prompt": (C, {"prompt": ""}, (400, "BadRequestError", "prompt")),
    "empty prompt list": (C, {"prompt": []}, (400, "BadRequestError", None)),
    "empty token list": (C, {"prompt": [[]]}, (400, "BadRequestError", None)),
    "prompt of mixed types": (C, {"prompt": [1, "a"]}, (400, "Bad Request", "body.prompt.1")),
    "token out of vocabulary": (C, {"prompt": [5, 200_000], "max_tokens": 1}, (400, "BadRequestError", None)),
    "malformed JSON": (CH, b'{"model": "tiny-llama", "messages": [', (400, "Bad Request", "body.37")),
    "trailing garbage": (C, b'{"prompt": "hi"} x', (400, "Bad Request", "body.17")),
    "body not an object": (C, b"[1, 2]", (400, "Bad Request", "body")),
    "empty body": (CH, b"", (400, "Bad Request", "body")),
    "continue_final_message with add_generation_prompt": (
        CH, {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
        (400, "BadRequestError", None)),
    "both flags win over field types": (  # vLLM's check is a model validator that runs before the fields
        CH, {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True, "max_tokens": "x"},
        (400, "BadRequestError", None)),
    "continue_final_message with the default generation prompt": (  # the chat template's refusal
        CH, {"messages": MESSAGES, "continue_final_message": True}, (400, "BadRequestError", None)),
}
#: Cases whose message text is not reproduced word for word (see EXCEPTIONS).
OWN_WORDS = {"message without a role": "validation_text", "message content a number": "validation_text",
             "prompt of mixed types": "validation_text", "stop not a string": "validation_text",
             "unknown content part": "chat_parts"}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_error_answers(target: Target, sim: Target, case: str) -> None:
    path, body, (status, err_type, param) = ERROR_CASES[case]

    def observe(t: Target) -> Any:
        url = f"{t.api}/{path}"
        resp = post_raw(url, body) if isinstance(body, bytes) else post_json(url, {"model": t.model, **body})
        assert resp.headers["content-type"] == "application/json"
        error = resp.json()
        assert (resp.status_code, error["error"]["type"], error["error"]["param"], error["error"]["code"]) \
            == (status, err_type, param, status), error
        expected = {"error": {**ERROR["error"], "param": "str" if param is not None else "null"}}
        assert_shape(shape(error), expected, case)
        return error["error"]["message"] if case not in OWN_WORDS else shape(error)

    compare(target, sim, observe, case)


def test_routing_errors(target: Target, sim: Target) -> None:
    def observe(t: Target) -> list[tuple[int, Any]]:
        answers = [httpx.get(f"{t.api}/nope", timeout=30), httpx.get(f"{t.api}/completions", timeout=30),
                   httpx.post(f"{t.api}/models", json={}, timeout=30),
                   httpx.put(f"{t.api}/chat/completions", timeout=30)]
        return [(r.status_code, r.json()) for r in answers]

    assert compare(target, sim, observe, "routing errors") == [
        (404, {"detail": "Not Found"}), (405, {"detail": "Method Not Allowed"}),
        (405, {"detail": "Method Not Allowed"}), (405, {"detail": "Method Not Allowed"})]


def test_sdk_errors(target: Target) -> None:
    c = client(target)
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert missing.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as too_long:
        c.completions.create(model=target.model, prompt=list(range(10, 610)), max_tokens=1)
    assert "maximum context length is 512 tokens" in too_long.value.message


# --- /metrics -------------------------------------------------------------------------------

#: The families Switchyard reads (engines/scrape.py) and those vLLM dashboards chart: type and labels.
CHARTED = {
    "vllm:num_requests_running": ("gauge", {"model_name", "engine"}),
    "vllm:num_requests_waiting": ("gauge", {"model_name", "engine"}),
    "vllm:kv_cache_usage_perc": ("gauge", {"model_name", "engine"}),
    "vllm:prefix_cache_queries": ("counter", {"model_name", "engine"}),
    "vllm:prefix_cache_hits": ("counter", {"model_name", "engine"}),
    "vllm:prompt_tokens": ("counter", {"model_name", "engine"}),
    "vllm:generation_tokens": ("counter", {"model_name", "engine"}),
    "vllm:num_preemptions": ("counter", {"model_name", "engine"}),
    "vllm:request_success": ("counter", {"model_name", "engine", "finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", {"model_name", "engine", "le"}),
    "vllm:inter_token_latency_seconds": ("histogram", {"model_name", "engine", "le"}),
    "vllm:request_time_per_output_token_seconds": ("histogram", {"model_name", "engine", "le"}),
    "vllm:e2e_request_latency_seconds": ("histogram", {"model_name", "engine", "le"}),
    "vllm:request_queue_time_seconds": ("histogram", {"model_name", "engine", "le"}),
    "vllm:request_prompt_tokens": ("histogram", {"model_name", "engine", "le"}),
    "vllm:request_generation_tokens": ("histogram", {"model_name", "engine", "le"}),
    "vllm:iteration_tokens_total": ("histogram", {"model_name", "engine", "le"}),
    "vllm:cache_config_info": ("gauge", None),
}
IGNORED_FAMILIES = ("process_", "python_", "http_")  # EXCEPTIONS["process_metrics"]


def _families(t: Target) -> Any:
    resp = httpx.get(f"{t.url}/metrics", timeout=30)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == CONTENT_TYPE_LATEST  # the Prometheus text format
    return metric_families(resp.text)


def test_metric_families(target: Target, sim: Target) -> None:
    families = _families(target)
    for name, (kind, labels) in CHARTED.items():
        assert name in families, f"{name} missing"
        assert families[name].type == kind, name
        if labels is not None:
            assert families[name].label_names == labels, name
    assert ("finished_reason", "length") in families["vllm:request_success"].enumerations
    assert {"block_size", "num_gpu_blocks", "enable_prefix_caching"} <= families["vllm:cache_config_info"].label_names
    if target.is_vllm:
        reference = _families(sim)
        names = without(families, IGNORED_FAMILIES)
        assert names == set(reference), (f"only in vLLM: {sorted(names - set(reference))}; "
                                         f"only in the sim: {sorted(set(reference) - names)}")
        for name in sorted(names):
            mine, theirs = reference[name], families[name]
            assert (mine.type, mine.label_names) == (theirs.type, theirs.label_names), name
            if name != "vllm:cache_config_info":  # EXCEPTIONS["info_values"]
                assert mine.enumerations == theirs.enumerations, name


def test_the_gateway_reads_the_same_signals(target: Target, sim: Target) -> None:
    def observe(t: Target) -> Any:
        signals = parse_engine_metrics(httpx.get(f"{t.url}/metrics", timeout=30).text)
        assert signals.prefix_queries >= signals.prefix_hits >= 0 and 0 <= signals.kv_usage <= 1
        # The served model's name, from the model_name label (the serves-model filter reads it).
        assert signals.models == frozenset({t.model}), signals.models
        return {k: type(v).__name__ for k, v in dataclasses.asdict(signals).items()}

    assert compare(target, sim, observe, "gateway signals") == {
        **dict.fromkeys(("running", "waiting", "kv_usage", "prefix_queries", "prefix_hits", "progress", "deferred"),
                        "float"),
        "models": "frozenset", "adapters": "NoneType", "max_loras": "NoneType"}  # (LoRA is off on these servers)


def test_counters_move_with_a_request(target: Target, sim: Target) -> None:
    ids = fresh_ids(40)
    counters = {"vllm:prompt_tokens_total": {}, "vllm:generation_tokens_total": {},
                "vllm:prefix_cache_queries_total": {}, "vllm:request_success_total": {"finished_reason": "length"},
                "vllm:time_to_first_token_seconds_count": {}, "vllm:e2e_request_latency_seconds_count": {},
                "vllm:request_queue_time_seconds_count": {}, "vllm:inter_token_latency_seconds_count": {},
                "vllm:request_params_n_count": {}, "vllm:request_params_max_tokens_sum": {},
                # Once per batch of engine outputs (5 steps made tokens), the prompt's 40 computed tokens with the
                # first token and one token per step (the gateway reads it to tell a working engine from a hung one).
                "vllm:iteration_tokens_total_count": {}, "vllm:iteration_tokens_total_sum": {}}

    def observe(t: Target) -> dict[str, float]:
        def read() -> dict[str, float]:
            text = httpx.get(f"{t.url}/metrics", timeout=30).text
            return {name: sample_value(text, name, **labels) for name, labels in counters.items()}

        before = read()
        resp = post_json(f"{t.api}/completions", {"model": t.model, "prompt": ids, "max_tokens": 5, **EXACT})
        assert resp.status_code == 200
        deltas: dict[str, float] = {}
        for _ in range(50):  # vLLM publishes an iteration's stats just after its outputs
            after = read()
            deltas = {k: after[k] - before[k] for k in counters}
            if deltas["vllm:request_success_total"] >= 1:
                break
            time.sleep(0.1)
        return deltas

    assert compare(target, sim, observe, "metric deltas") == {
        "vllm:prompt_tokens_total": 40, "vllm:generation_tokens_total": 5, "vllm:prefix_cache_queries_total": 40,
        "vllm:request_success_total": 1, "vllm:time_to_first_token_seconds_count": 1,
        "vllm:e2e_request_latency_seconds_count": 1, "vllm:request_queue_time_seconds_count": 1,
        "vllm:inter_token_latency_seconds_count": 4, "vllm:request_params_n_count": 1,
        "vllm:request_params_max_tokens_sum": 5, "vllm:iteration_tokens_total_count": 5,
        "vllm:iteration_tokens_total_sum": 45}


def test_exceptions_are_explained() -> None:
    """Every deliberate difference has a reason, and the error cases cite existing entries."""
    assert all(reason.strip().endswith(".") for reason in EXCEPTIONS.values())
    assert set(OWN_WORDS.values()) <= set(EXCEPTIONS)
    assert set(OWN_WORDS) <= set(ERROR_CASES)
