"""``POST /v1/embeddings`` of the simulated engine: shape, determinism, similarity, encodings, errors."""

from __future__ import annotations

import base64
import json
import math
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from switchyard.sim import EngineConfig, create_engine_app
from switchyard.sim.embeddings import EMBEDDING_DIM, embed_text, text_features
from switchyard.simtext.tokens import tokenize

Client = AsyncTestClient  # type: ignore[type-arg]


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    app = create_engine_app(EngineConfig(served_model="embed", port=1, time_scale=1000, max_model_len=64,
                                         kv_cache_tokens=4096, seed=1))
    async with AsyncTestClient(app=app) as c:
        yield c


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


async def _embed(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post("/v1/embeddings", json=body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


async def test_response_has_vllms_shape(client: Client) -> None:
    texts = ["Hello world", "How do I reset my password?"]
    resp = await client.post("/v1/embeddings", headers={"x-request-id": "abc"},
                             json={"model": "embed", "input": texts, "user": "u1"})
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert body["id"] == "embd-abc"
    assert (body["object"], body["model"]) == ("list", "embed")
    assert isinstance(body["created"], int)
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "embedding"), (1, "embedding")]
    for d in body["data"]:
        assert len(d["embedding"]) == EMBEDDING_DIM
        assert math.isclose(math.sqrt(sum(v * v for v in d["embedding"])), 1.0, rel_tol=1e-5)
    tokens = sum(1 + len(tokenize(t)) for t in texts)  # each text with its BOS token, as generation counts
    # vLLM's UsageInfo, key for key (the details null, completion_tokens 0).
    assert list(body["usage"].items()) == [("prompt_tokens", tokens), ("total_tokens", tokens),
                                           ("completion_tokens", 0), ("prompt_tokens_details", None),
                                           ("completion_tokens_details", None)]


async def test_every_input_form_is_accepted(client: Client) -> None:
    one = await _embed(client, {"input": "just one"})  # the model may be left out
    assert len(one["data"]) == 1
    assert one["id"].startswith("embd-")
    ids = await _embed(client, {"input": [5, 6, 7]})
    assert len(ids["data"]) == 1
    assert ids["usage"]["prompt_tokens"] == 3
    many = await _embed(client, {"input": [[5, 6], [7]]})
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert many["usage"]["prompt_tokens"] == 3


async def test_embeddings_are_deterministic(client: Client) -> None:
    text = "Cancel my subscription and refund the last charge"
    first = (await _embed(client, {"input": text}))["data"][0]["embedding"]
    again = (await _embed(client, {"input": [text, "other"]}))["data"][0]["embedding"]
    assert first == again
    assert first == pytest.approx(embed_text(text), abs=1e-7)  # float32 of the same vector


def test_embeddings_are_the_same_in_every_process() -> None:
    text = "Cancel my subscription and refund the last charge"
    code = f"import json; from switchyard.sim.embeddings import embed_text; print(json.dumps(embed_text({text!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout  # another str-hash seed
    assert json.loads(out) == embed_text(text)


def test_texts_sharing_words_are_closer_than_unrelated_ones() -> None:
    base = embed_text("How do I reset my password?")
    close = embed_text("I forgot my password and need to reset it")
    far = embed_text("The weather in Paris is sunny today")
    assert _cos(base, close) > 0.4
    assert abs(_cos(base, far)) < 0.2
    # Forms of a word share character trigrams.
    assert _cos(embed_text("refund"), embed_text("refunds")) > _cos(embed_text("refund"), embed_text("poem")) + 0.2
    # Function words weigh little: two sentences made mostly of them are not alike.
    assert _cos(embed_text("what is the cat doing in the house"),
                embed_text("what is the stock price in the market")) < 0.3


def test_features_are_case_insensitive_and_empty_text_still_has_a_vector() -> None:
    assert text_features("Reset PASSWORD") == text_features("reset password")
    empty = embed_text("")
    assert math.isclose(sum(v * v for v in empty), 1.0)
    assert empty == embed_text("?!")


async def test_base64_is_little_endian_float32(client: Client) -> None:
    text = "Explain quicksort in Python"
    floats = (await _embed(client, {"input": text, "encoding_format": "float"}))["data"][0]["embedding"]
    encoded = (await _embed(client, {"input": text, "encoding_format": "base64"}))["data"][0]["embedding"]
    assert isinstance(encoded, str)
    raw = base64.b64decode(encoded)
    assert len(raw) == 4 * EMBEDDING_DIM
    assert list(struct.unpack(f"<{EMBEDDING_DIM}f", raw)) == floats


async def test_dimensions_keep_the_leading_entries_renormalised(client: Client) -> None:
    short = (await _embed(client, {"input": "hello there", "dimensions": 64}))["data"][0]["embedding"]
    assert len(short) == 64
    assert math.isclose(math.sqrt(sum(v * v for v in short)), 1.0, rel_tol=1e-5)
    assert short == pytest.approx(embed_text("hello there", 64), abs=1e-7)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "other", "input": "x"}, 404, None),
    ({"model": "embed"}, 400, "body.input"),
    ({"input": 5}, 400, "body.input"),
    ({"input": [1, "a"]}, 400, "body.input.1"),
    ({"input": [[1], ["a"]]}, 400, "body.input.1.0"),
    ({"input": [1.5]}, 400, "body.input.0"),
    ({"input": []}, 400, None),
    ({"input": [[1], []]}, 400, None),
    ({"input": "x", "encoding_format": "hex"}, 400, "body.encoding_format"),
    ({"input": "x", "dimensions": 0}, 400, None),
    ({"input": "x", "dimensions": EMBEDDING_DIM + 1}, 400, None),
    ({"input": "x", "dimensions": "many"}, 400, "body.dimensions"),
    ({"input": "x", "user": 3}, 400, "body.user"),
    ({"input": [10**9]}, 400, None),
    ({"input": "word " * 100}, 400, "input_tokens"),
    ({"input": list(range(10, 80))}, 400, "input_tokens"),
])
async def test_client_mistakes_get_vllms_errors(client: Client, body: dict[str, Any], status: int,
                                                param: str | None) -> None:
    resp = await client.post("/v1/embeddings", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, status)


async def test_refusals_name_the_problem(client: Client) -> None:
    """vLLM's pooling server's own words (``/tmp/vllm-facts.md`` section 2; the generation server's 404
    names the served models and the param, this one neither)."""

    async def error(body: dict[str, Any]) -> dict[str, Any]:
        resp = await client.post("/v1/embeddings", json=body)
        assert resp.status_code in (400, 404), resp.text
        out: dict[str, Any] = resp.json()["error"]
        return out

    assert await error({"model": "other", "input": "x"}) == {
        "message": "The model `other` does not exist.", "type": "NotFoundError", "param": None, "code": 404}
    assert await error({"input": []}) == {
        "message": "You must pass at least one prompt", "type": "BadRequestError", "param": None, "code": 400}
    assert await error({"input": [[]]}) == {
        "message": "The decoder prompt cannot be empty", "type": "BadRequestError", "param": None, "code": 400}
    assert await error({"input": "x", "dimensions": EMBEDDING_DIM + 1}) == {
        "message": f"Model 'embed' only supports dimensions in range [1, {EMBEDDING_DIM}], got {EMBEDDING_DIM + 1}.",
        "type": "BadRequestError", "param": None, "code": 400}
    assert (await error({"input": "x", "dimensions": 0}))["message"] == (
        f"Model 'embed' only supports dimensions in range [1, {EMBEDDING_DIM}], got 0.")
    # Token ids are counted exactly; a text is tokenized one token past the window ("at least").
    assert await error({"input": list(range(10, 80))}) == {
        "message": "This model's maximum context length is 64 tokens. However, your prompt contains 70 input "
                   "tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                   "the input prompt. (parameter=input_tokens, value=70)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}
    assert (await error({"input": "word " * 100}))["message"] == (
        "This model's maximum context length is 64 tokens. However, your prompt contains at least 65 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=65)")
    assert (await error({"input": [5, 200_000]}))["message"] == "Token id 200000 is out of vocabulary"


async def test_refusals_come_in_vllms_order(client: Client) -> None:
    """The model, then at least one prompt, every prompt's length, ``dimensions``, then prompt by prompt:
    empty, out of vocabulary."""

    async def message(body: dict[str, Any]) -> str:
        resp = await client.post("/v1/embeddings", json=body)
        assert resp.status_code in (400, 404), resp.text
        return str(resp.json()["error"]["message"])

    assert (await message({"model": "other", "input": [], "dimensions": 0})).startswith("The model `other`")
    assert await message({"input": [], "dimensions": 0}) == "You must pass at least one prompt"
    assert (await message({"input": [[], list(range(10, 80))], "dimensions": 0})).startswith(
        "This model's maximum context length")
    assert (await message({"input": [[]], "dimensions": 0})).startswith("Model 'embed' only supports dimensions")
    assert await message({"input": [[5, 200_000], []]}) == "Token id 200000 is out of vocabulary"
    assert await message({"input": [[], [5, 200_000]]}) == "The decoder prompt cannot be empty"


    for raw in (b"", b"{", b"[]"):
        assert (await client.post("/v1/embeddings", content=raw)).status_code == 400
    resp = await client.get("/v1/embeddings")
    assert (resp.status_code, resp.json()) == (405, {"detail": "Method Not Allowed"})


async def test_faults_apply_and_engine_metrics_stay_untouched(client: Client) -> None:
    await _embed(client, {"input": ["a few words", "and more"]})
    metrics = (await client.get("/metrics")).text
    assert 'vllm:prompt_tokens_total{engine="0",model_name="embed"} 0.0' in metrics
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="embed"} 0.0' in metrics

    await client.post("/sim/faults", json={"error_rate": 1.0})
    resp = await client.post("/v1/embeddings", json={"input": "x"})
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "InternalServerError"
    await client.post("/sim/faults", json={"error_rate": 0.0, "throttle_rate": 1.0})
    resp = await client.post("/v1/embeddings", json={"input": "x"})
    assert (resp.status_code, resp.headers["retry-after"]) == (429, "1")
    await client.post("/sim/faults", json={"throttle_rate": 0.0, "mode": "unavailable"})
    assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 503
    await client.post("/sim/faults", json={"mode": "slow", "slow_factor": 2})
    assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 200
