"""``POST /v1/embeddings``: vLLM's (OpenAI's) embeddings API over a deterministic feature-hashing model.

The vector of a text is built the way a hashing vectoriser builds one: lower-cased word unigrams,
word bigrams and the character trigrams of each word are hashed (BLAKE2b, so every process agrees)
into :data:`EMBEDDING_DIM` signed buckets, and the sum is L2-normalised. Texts that share words,
or forms of a word ("refund", "refunds"), point the same way; texts with nothing in common are
nearly orthogonal. That is not a language model, but it is enough for what the gateway does with
embeddings (nearest-centroid classifiers over a handful of examples) to behave sensibly in tests
and demos. Common function words ("the", "is", ...) weigh little so they do not make every
sentence alike. Token-id inputs are hashed from their ids (unigrams and bigrams).

Embeddings do not go through the engine's scheduler, KV cache or ``/metrics``: every simulated
engine answers them (the simulator does not tell generative from pooling models apart), and a
request takes one simulated forward pass over its inputs (the profile's frontend overhead plus one
step over all their tokens), stretched by the ``slow`` fault mode, held by ``hang`` and, in ``drip``,
taking at least ``drip_interval_s`` (one step per interval); ``error`` and ``down`` answer as they
do for generation.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import math
import re
import sys
import time
import uuid
from array import array
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec

from switchyard.sim.generate import ClientWatch, read_post, send_cut, send_json
from switchyard.sim.profiles import EngineProfile
from switchyard.sim.protocol import check_context
from switchyard.sim.runtime import EngineRuntime
from switchyard.sim.validation import ApiError, Fields, bad, decode_body, invalid, lax_int
from switchyard.simtext.tokens import SPECIAL_TOKENS, tokenize

Scope = dict[str, Any]
Receive = Callable[[], Any]
Send = Callable[[dict[str, Any]], Any]

#: Size of every embedding (that of the common small sentence-embedding models).
EMBEDDING_DIM = 384
_BOS = SPECIAL_TOKENS["<|begin_of_text|>"]
_WORD = re.compile(r"[^\W_]+")
_STOP_WORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "can", "could", "did", "do", "does", "for", "from",
    "had", "has", "have", "how", "i", "if", "in", "into", "is", "it", "its", "me", "my", "no", "not", "of", "on",
    "or", "our", "please", "so", "than", "that", "the", "their", "them", "then", "there", "these", "they", "this",
    "to", "was", "we", "were", "what", "when", "where", "which", "who", "why", "will", "with", "would", "you",
    "your"))
_STOP_WEIGHT = 0.2
_BIGRAM_WEIGHT = 0.7
_FORMATS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsSpec:
    """A validated embeddings request.

    Attributes:
        texts: Each input's text, or None for an input given as token ids.
        prompts: Each input's token ids (a text's with the BOS token vLLM adds).
        encoding_format: ``float`` (JSON numbers) or ``base64`` (little-endian float32 bytes).
        dimensions: Leading dimensions to keep (then re-normalised), or None for all.
    """

    texts: list[str | None]
    prompts: list[list[int]]
    encoding_format: str
    dimensions: int | None


# --- the model ------------------------------------------------------------------------------------

@lru_cache(maxsize=65_536)
def _bucket(feature: str) -> tuple[int, float]:
    """The bucket of a feature and its sign (stable across processes, unlike ``hash()``)."""
    h = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "little")
    return h % EMBEDDING_DIM, 1.0 if h >> 63 else -1.0


def text_features(text: str) -> dict[str, float]:
    """The weighted features of a text: words, word bigrams and each word's character trigrams."""
    words = _WORD.findall(text.lower())
    features: dict[str, float] = {}

    def add(feature: str, weight: float) -> None:
        features[feature] = features.get(feature, 0.0) + weight

    for word in words:
        if word in _STOP_WORDS:
            add("w:" + word, _STOP_WEIGHT)
            continue
        add("w:" + word, 1.0)
        padded = f"<{word}>"
        grams = [padded[i:i + 3] for i in range(len(padded) - 2)]
        # Each word's trigrams together weigh as much as the word (unit norm when they do not collide).
        share = 1.0 / math.sqrt(len(grams))
        for gram in grams:
            add("c:" + gram, share)
    for first, second in itertools.pairwise(words):
        if first in _STOP_WORDS and second in _STOP_WORDS:
            continue
        add(f"b:{first} {second}", _BIGRAM_WEIGHT)
    return features


def token_features(ids: list[int]) -> dict[str, float]:
    """The weighted features of a prompt given as token ids: ids and id bigrams."""
    features: dict[str, float] = {}
    for t in ids:
        features[f"t:{t}"] = features.get(f"t:{t}", 0.0) + 1.0
    for a, b in itertools.pairwise(ids):
        features[f"t:{a},{b}"] = features.get(f"t:{a},{b}", 0.0) + _BIGRAM_WEIGHT
    return features


def embed_features(features: dict[str, float], dimensions: int | None = None) -> list[float]:
    """The L2-normalised hashed vector of ``features`` (its first ``dimensions`` entries, re-normalised).

    A text without any word (empty, only punctuation) gets the vector of a fixed placeholder feature.
    """
    vector = [0.0] * EMBEDDING_DIM
    for feature, weight in (features or {"<empty>": 1.0}).items():
        index, sign = _bucket(feature)
        vector[index] += sign * weight
    if dimensions is not None:
        vector = vector[:dimensions]
    norm = math.sqrt(math.fsum(v * v for v in vector))
    if norm == 0.0:  # every feature cancelled out, or fell outside the kept dimensions
        vector[0], norm = 1.0, 1.0
    return [v / norm for v in vector]


def embed_text(text: str, dimensions: int | None = None) -> list[float]:
    """The simulator's embedding of ``text`` (deterministic; unit length)."""
    return embed_features(text_features(text), dimensions)


def embedding_seconds(profile: EngineProfile, lengths: list[int]) -> float:
    """Simulated time of one embeddings request: the frontend, then one forward pass over every input."""
    total = sum(lengths)
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return profile.frontend_overhead_s + profile.step_seconds(total, len(lengths), total, pairs)


# --- the request ----------------------------------------------------------------------------------

def _check_input_types(value: object) -> None:
    """The type checks pydantic applies to ``input`` (a string, strings, token ids or lists of them)."""
    if isinstance(value, str):
        return
    if not isinstance(value, list):
        raise invalid("list_type", "body.input", "Input should be a valid list", value)
    if all(isinstance(v, str) for v in value):
        return
    if value and all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            for j, t in enumerate(ids):
                if isinstance(t, list | dict) or t is None:
                    raise invalid("int_type", f"body.input.{i}.{j}", "Input should be a valid integer", t)
                lax_int(t, f"body.input.{i}.{j}")
        return
    for i, t in enumerate(value):
        if isinstance(t, list | dict) or t is None:
            raise invalid("int_type", f"body.input.{i}", "Input should be a valid integer", t)
        lax_int(t, f"body.input.{i}")


def _render(value: str | list[Any]) -> tuple[list[str | None], list[list[int]], bool]:
    """Each input's text (None for token ids), its token ids, and whether they came from text."""
    if isinstance(value, str):
        return [value], [[_BOS, *tokenize(value)]], True
    if not value:
        raise bad("You must pass at least one prompt", None)
    if all(isinstance(v, str) for v in value):
        return list(value), [[_BOS, *tokenize(v)] for v in value], True
    if all(isinstance(v, list) for v in value):
        return [None] * len(value), [[lax_int(t, "body.input") for t in v] for v in value], False
    return [None], [[lax_int(t, "body.input") for t in value]], False


def parse_embeddings(body: dict[str, Any], *, served_model: str, vocab_size: int,
                     max_model_len: int, adapters: Collection[str] = ()) -> EmbeddingsSpec:
    """Validate an embeddings request body (unknown fields are ignored, as vLLM does).

    The checks come in vLLM's order: the body's types, the model (the base model or one of ``adapters``),
    at least one prompt, every prompt's length (the renderer), ``dimensions`` (``PoolingParams.verify``),
    then each prompt in turn: not empty, every id in the vocabulary (the engine's input processor).

    Raises:
        ApiError: 400 for a malformed request, 404 for an unknown model.
    """
    if "input" not in body:
        raise invalid("missing", "body.input", "Field required", body)
    _check_input_types(body["input"])
    f = Fields(body)
    model = f.get_str("model")
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in _FORMATS:
        raise invalid("literal_error", "body.encoding_format", "Input should be 'float' or 'base64'", encoding,
                      {"expected": "'float' or 'base64'"})
    dimensions = f.get_int("dimensions")
    f.get_str("user")
    if model is not None and model != served_model and model not in adapters:
        # The pooling server's own 404 (``_maybe_get_adapters``): no aliases, no param.
        raise ApiError(404, f"The model `{model}` does not exist.")
    texts, prompts, from_text = _render(body["input"])
    for prompt in prompts:  # the renderer's length check, every prompt before the engine sees one
        check_context(len(prompt), max_model_len, from_text)
    if dimensions is not None and not 1 <= dimensions <= EMBEDDING_DIM:  # PoolingParams.verify
        raise bad(f"Model {served_model!r} only supports dimensions in range [1, {EMBEDDING_DIM}], "
                  f"got {dimensions}.", None)
    for prompt in prompts:  # the engine's input checks, prompt by prompt
        if not prompt:
            raise bad("The decoder prompt cannot be empty", None)
        for t in prompt:
            if not 0 <= t < vocab_size:
                raise bad(f"Token id {t} is out of vocabulary", None)
    return EmbeddingsSpec(texts=texts, prompts=prompts, encoding_format=encoding or "float", dimensions=dimensions)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    packed = array("f", vector)  # float32, as the model's output tensor
    if encoding_format == "base64":
        if sys.byteorder == "big":
            packed.byteswap()
        return base64.b64encode(packed.tobytes()).decode("ascii")
    return packed.tolist()


def embeddings_body(spec: EmbeddingsSpec, model: str, request_id: str | None = None) -> bytes:
    """The JSON response to a validated request, in vLLM's ``EmbeddingResponse`` shape."""
    data = []
    for i, (text, prompt) in enumerate(zip(spec.texts, spec.prompts, strict=True)):
        features = text_features(text) if text is not None else token_features(prompt)
        vector = embed_features(features, spec.dimensions)
        data.append({"index": i, "object": "embedding", "embedding": _encode(vector, spec.encoding_format)})
    tokens = sum(len(p) for p in spec.prompts)
    return msgspec.json.encode({
        "id": "embd-" + (request_id or uuid.uuid4().hex), "object": "list", "created": int(time.time()),
        "model": model, "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None, "completion_tokens_details": None},
    })


# --- the handler ----------------------------------------------------------------------------------

async def _until_gone(watch: ClientWatch, waiting: asyncio.Future[Any]) -> bool:
    """Wait for ``waiting`` or the client's departure, whichever comes first; whether it is still there."""
    gone = asyncio.ensure_future(watch.gone.wait())
    try:
        await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        gone.cancel()
    return not watch.gone.is_set()


async def _take_time(engine: EngineRuntime, watch: ClientWatch, sim_seconds: float) -> bool:
    """Hold the request while the fault mode is ``hang``, then for its simulated duration (times the
    ``slow`` factor; at least the drip interval in ``drip``); False when the client left meanwhile."""
    faults = engine.faults
    while faults.hung:
        if not await _until_gone(watch, asyncio.ensure_future(faults.wait_changed())):
            return False
    delay = sim_seconds * faults.step_factor / engine.scale
    if faults.mode == "drip":
        delay = max(delay, faults.drip_interval_s)
    return await _until_gone(watch, asyncio.ensure_future(asyncio.sleep(delay)))


async def handle_embeddings(engine: EngineRuntime, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one ``POST /v1/embeddings`` request."""
    accepted = await read_post(engine, scope, receive, send)
    if accepted is None:
        return
    cfg = engine.config
    adapter = None
    try:
        request = decode_body(accepted.body)
        # A ``model`` naming a LoRA adapter is served too, and answered under its name.
        adapter = engine.adapter(request.get("model"))
        spec = parse_embeddings(request, served_model=cfg.served_model, vocab_size=cfg.profile.vocab_size,
                                max_model_len=cfg.max_model_len, adapters=() if adapter is None else (adapter.name,))
    except ApiError as exc:
        if exc.status == 404:
            engine.unknown_model()
        await send_json(send, exc.status, exc.body())
        return
    watch = ClientWatch(receive, lambda: None)
    try:
        if not await _take_time(engine, watch, embedding_seconds(cfg.profile, [len(p) for p in spec.prompts])):
            return
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or None
        body = embeddings_body(spec, engine.served_name(adapter), request_id)
        await (send_cut(send, body) if accepted.abort else send_json(send, 200, body))
    finally:
        watch.close()
