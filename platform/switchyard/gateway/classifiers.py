"""Embedding classifiers: the score of a request's last user message against a classifier's examples.

A policy's ``classifiers: {NAME: {type: embedding, pool, examples: {positive, negative}, threshold,
timeout_ms}}`` is a nearest-centroid classifier. The gateway embeds the examples once per embedding
model and example set (one ``/v1/embeddings`` call for all of them, the first query riding along),
keeps the two centroids, and for each request embeds its last user message and scores it::

    score = (1 + cos(q, positive centroid) - cos(q, negative centroid)) / 2      in [0, 1]

Classifying must never fail a request: a timeout (``timeout_ms``, for the whole call), a refused
connection, an engine error or a malformed answer gives no score (None), and the rule that needed it
does not match. A refused connection also takes the endpoint out (until its health probes succeed), as
the proxy does, so the next request goes to another replica of the pool. :meth:`ClassifierRunner.embed`
serves the semantic response cache the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
import msgspec

from switchyard.engines.endpoints import EndpointRegistry
from switchyard.engines.upstream import read_engine_error
from switchyard.policy.fleet import Pool
from switchyard.policy.routing import EmbeddingClassifier
from switchyard.policy.snapshot import PolicySnapshot

if TYPE_CHECKING:
    from switchyard.decide.features import RequestFeatures
    from switchyard.gateway.metrics import GatewayMetrics

log = logging.getLogger("switchyard.classifiers")

#: Centroid pairs kept (one per embedding model and example set; a reload may bring new ones).
CENTROID_CACHE_SIZE = 64
#: The query is cut to this many characters: embedding models commonly take 512 tokens, and a longer
#: input would be refused (no score) rather than truncated.
MAX_QUERY_CHARS = 2000
_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


# --- the maths ------------------------------------------------------------------------------------

def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of the angle between ``a`` and ``b`` (0 when either is the zero vector).

    Raises:
        ValueError: The vectors differ in length.
    """
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} dimensions")
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms > 0.0 else 0.0


def centroid(vectors: Sequence[Sequence[float]]) -> list[float]:
    """The mean of ``vectors``.

    Raises:
        ValueError: No vectors, or vectors of different lengths.
    """
    if not vectors:
        raise ValueError("the centroid of no vectors")
    size = len(vectors[0])
    if any(len(v) != size for v in vectors):
        raise ValueError("vectors of different dimensions")
    n = len(vectors)
    return [math.fsum(column) / n for column in zip(*vectors, strict=True)]


def nearest_centroid_score(query: Sequence[float], positive: Sequence[float], negative: Sequence[float]) -> float:
    """``(1 + cos(query, positive) - cos(query, negative)) / 2``, clamped to [0, 1].

    1 is as close to the positive examples (and as far from the negative ones) as can be, 0 the
    reverse, 0.5 undecided.

    Raises:
        ValueError: The vectors differ in length.
    """
    score = (1.0 + cosine(query, positive) - cosine(query, negative)) / 2.0
    return min(1.0, max(0.0, score))


# --- calling the embeddings pool ------------------------------------------------------------------

class ClassifierError(Exception):
    """The embedding could not be had (the engine refused the connection, erred, or answered nonsense)."""


class _Datum(msgspec.Struct):
    index: int
    embedding: list[float]


class _EmbeddingsAnswer(msgspec.Struct):
    data: list[_Datum]


@dataclass(frozen=True, slots=True)
class Centroids:
    """The centroids of one classifier's positive and negative examples."""

    positive: list[float]
    negative: list[float]


_CacheKey = tuple[str, tuple[str, ...], tuple[str, ...]]


def _vectors(raw: bytes, expected: int) -> list[list[float]]:
    """The embeddings of an answer, in input order.

    Raises:
        ClassifierError: The body is not an embeddings answer for ``expected`` inputs.
    """
    try:
        answer = msgspec.json.decode(raw, type=_EmbeddingsAnswer)
    except msgspec.DecodeError as exc:
        raise ClassifierError(f"malformed embeddings answer: {exc}") from None
    if sorted(d.index for d in answer.data) != list(range(expected)):
        raise ClassifierError(f"the embeddings answer has {len(answer.data)} items for {expected} inputs")
    vectors = [d.embedding for d in sorted(answer.data, key=lambda d: d.index)]
    size = len(vectors[0])
    if size == 0 or any(len(v) != size for v in vectors):
        raise ClassifierError("the embeddings answer has empty or uneven vectors")
    return vectors


class ClassifierRunner:
    """Scores requests with the policy's embedding classifiers (one per gateway process).

    Args:
        http: The gateway's client session (its connection pool to the engines).
        endpoints: Endpoint states: embeddings go to healthy endpoints, and a refused connection
            takes one out (until its health probes succeed).
        metrics: Where outcomes and durations are counted (``switchyard_classifier_total``,
            ``switchyard_classifier_seconds``); None counts nothing.
    """

    def __init__(self, http: aiohttp.ClientSession, endpoints: EndpointRegistry,
                 metrics: GatewayMetrics | None = None) -> None:
        self.http = http
        self.endpoints = endpoints
        self.metrics = metrics
        self._centroids: OrderedDict[_CacheKey, Centroids] = OrderedDict()
        self._fetching: dict[_CacheKey, asyncio.Task[list[list[float]]]] = {}
        self._turns: dict[str, itertools.count[int]] = {}

    async def score(self, snapshot: PolicySnapshot, name: str, features: RequestFeatures) -> float | None:
        """The score of classifier ``name`` for the request, or None when it could not be had in time.

        Args:
            snapshot: The request's policy snapshot (it names the classifier, its pool and examples).
            name: An embedding classifier of ``snapshot``.
            features: The request; its last user message is classified.

        Returns:
            The score in [0, 1] (the rule matches when it is at least the classifier's threshold), or
            None after a timeout or an error.
        """
        spec = snapshot.document.classifiers[name]
        assert isinstance(spec, EmbeddingClassifier), f"classifier {name} is not an embedding classifier"
        pool = snapshot.pools[spec.pool]
        started = time.perf_counter()
        score: float | None = None
        try:
            async with asyncio.timeout(spec.timeout_ms / 1000):
                centroids, query = await self._centroids_and_query(spec, pool, features.last_user_text)
            score = nearest_centroid_score(query, centroids.positive, centroids.negative)
            outcome = "yes" if score >= spec.threshold else "no"
        except TimeoutError:
            outcome = "timeout"
            log.debug("classifier %s: no embedding from pool %s within %d ms", name, pool.name, spec.timeout_ms)
        except (ClassifierError, ValueError) as exc:  # ValueError: the query's and centroids' sizes differ
            outcome = "error"
            log.debug("classifier %s: %s", name, exc)
        if self.metrics is not None:
            self.metrics.classifier_outcomes.labels(name, outcome).inc()
            self.metrics.classifier_seconds.labels(name).observe(time.perf_counter() - started)
        return score

    async def embed(self, pool: Pool, text: str, timeout_s: float) -> list[float]:
        """The embedding of ``text`` (cut to ``MAX_QUERY_CHARS``) from ``pool`` within ``timeout_s``.

        Raises:
            ClassifierError: No endpoint gave an answer.
            TimeoutError: None came in time.
        """
        vectors = await asyncio.wait_for(self._embed(pool, [text[:MAX_QUERY_CHARS]]), timeout_s)
        return vectors[0]

    def close(self) -> None:
        """Cancel the example embeddings still being fetched (at shutdown)."""
        for task in self._fetching.values():
            task.cancel()

    # --- centroids ----------------------------------------------------------------------------------

    async def _centroids_and_query(self, spec: EmbeddingClassifier, pool: Pool,
                                   text: str) -> tuple[Centroids, list[float]]:
        query = text[:MAX_QUERY_CHARS]
        examples = spec.examples
        key: _CacheKey = (pool.served_model, tuple(examples.positive), tuple(examples.negative))
        cached = self._centroids.get(key)
        if cached is not None:
            self._centroids.move_to_end(key)
            (vector,) = await self._embed(pool, [query])
            return cached, vector
        fetching = self._fetching.get(key)
        if fetching is None:
            # The first request fetches the examples, its own query riding along in the same call. The
            # fetch is shared (concurrent first requests wait for it rather than fetch again) and shielded:
            # it ends by its own deadline even if the request that started it gives up first.
            fetching = asyncio.get_running_loop().create_task(
                self._fetch(key, pool, [*examples.positive, *examples.negative, query], spec.timeout_ms / 1000),
                name=f"classifier-examples-{pool.name}")
            self._fetching[key] = fetching
            fetching.add_done_callback(lambda task: self._fetched(key, task))
            vectors = await asyncio.shield(fetching)
            return self._centroids_of(key, vectors), vectors[-1]
        own = asyncio.ensure_future(self._embed(pool, [query]))
        try:
            vectors = await asyncio.shield(fetching)
            (vector,) = await own
        finally:
            if not own.done():
                own.cancel()
            elif not own.cancelled():
                own.exception()  # retrieved: the shared fetch's failure is the one reported
        return self._centroids_of(key, vectors), vector

    async def _fetch(self, key: _CacheKey, pool: Pool, texts: list[str], timeout_s: float) -> list[list[float]]:
        async with asyncio.timeout(timeout_s):
            vectors = await self._embed(pool, texts)
        self._store(key, vectors)
        return vectors

    def _centroids_of(self, key: _CacheKey, vectors: list[list[float]]) -> Centroids:
        found = self._centroids.get(key)
        return found if found is not None else self._store(key, vectors)

    def _store(self, key: _CacheKey, vectors: list[list[float]]) -> Centroids:
        positives = len(key[1])
        negatives = len(key[2])
        centroids = Centroids(centroid(vectors[:positives]), centroid(vectors[positives:positives + negatives]))
        self._centroids[key] = centroids
        self._centroids.move_to_end(key)
        while len(self._centroids) > CENTROID_CACHE_SIZE:
            self._centroids.popitem(last=False)
        return centroids

    def _fetched(self, key: _CacheKey, task: asyncio.Task[list[list[float]]]) -> None:
        if self._fetching.get(key) is task:
            del self._fetching[key]
        if not task.cancelled() and task.exception() is not None:
            # Retrieved here so that a fetch whose requests all gave up is not reported as unhandled; the
            # next request fetches again.
            log.debug("classifier examples for %s not embedded: %r", key[0], task.exception())

    # --- one embeddings call --------------------------------------------------------------------------

    def _candidates(self, pool: Pool) -> list[str]:
        """The pool's healthy endpoints (all when none is: a try beats no answer), starting at the next in turn."""
        now = time.monotonic()
        urls = [u for u in pool.endpoints if self.endpoints.state(u).healthy(now)] or list(pool.endpoints)
        turn = self._turns.setdefault(pool.name, itertools.count())
        start = next(turn) % len(urls)
        return urls[start:] + urls[:start]

    async def _embed(self, pool: Pool, texts: list[str]) -> list[list[float]]:
        """The embeddings of ``texts`` from one of the pool's endpoints (the next one if it refuses).

        Raises:
            ClassifierError: No endpoint gave an answer.
        """
        payload = msgspec.json.encode({"model": pool.served_model, "input": texts, "encoding_format": "float"})
        refused: list[str] = []
        for url in self._candidates(pool):
            try:
                return await self._post(url, payload, len(texts))
            except aiohttp.ClientConnectorError as exc:
                reason = f"cannot connect to {url}: {exc.os_error.strerror or exc.os_error}"
                self.endpoints.mark_down(url, reason)
                refused.append(reason)
        raise ClassifierError("; ".join(refused))

    async def _post(self, url: str, payload: bytes, expected: int) -> list[list[float]]:
        try:
            async with self.http.post(url + "/v1/embeddings", data=payload, headers=_HEADERS,
                                      allow_redirects=False) as response:
                if response.status >= 300:
                    error = await read_engine_error(response)
                    raise ClassifierError(f"{url} answered {error.status}: {error.message[:200]}")
                raw = await response.read()
        except (aiohttp.ClientConnectorError, TimeoutError):  # the caller's to handle (mark down; timeout)
            raise
        except aiohttp.ClientError as exc:
            raise ClassifierError(f"{url}: {exc.__class__.__name__}: {exc}") from None
        return _vectors(raw, expected)
