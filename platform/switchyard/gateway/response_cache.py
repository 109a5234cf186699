"""The response cache on the request path: looked up before admission, filled after a complete answer.

``decide.cache`` says which rule applies and computes the keys; this module carries it out on the
backend (:mod:`switchyard.store.cache`: this process's memory, or Redis shared by every replica):

- **Lookup.** Exact rules read the entry under the request's key. Semantic rules embed the last user
  turn with the rule's ``embedding_pool`` (through the classifiers' embedding client, at most
  ``EMBED_TIMEOUT_S``) and take the nearest cached turn of the same conversation context above
  ``min_similarity``. A cache or embedding failure is a miss (counted ``error``), never a failed request.
- **Hit.** The cached complete answer is sent as it is, or replayed as a well-formed SSE stream
  (:mod:`switchyard.gateway.cache_replay`) to a streaming client. ``x-switchyard-cache`` says
  ``hit``, the rule, the mode and (semantic) the similarity.
- **Store.** A miss's answer is stored once it is complete: a 200 whose every choice finished
  (``stop``, ``length``, ``tool_calls``) with usage, no larger than the rule's ``max_entry_bytes``; a
  stream is assembled into the complete answer first, and a broken or cancelled one is never stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from litestar import Response

from switchyard.decide.cache import CachePlan
from switchyard.engines.splice import stream_kind
from switchyard.gateway.cache_assemble import assemble
from switchyard.gateway.cache_replay import for_client, replay
from switchyard.gateway.classifiers import ClassifierError, ClassifierRunner
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.policy.snapshot import PolicySnapshot
from switchyard.store.cache import CacheEntry, ResponseCache

log = logging.getLogger("switchyard.cache")

#: Longest wait for the embedding of a semantic lookup (a miss after that).
EMBED_TIMEOUT_S = 0.5
#: Finish reasons of a complete answer worth storing.
COMPLETE = frozenset({"stop", "length", "tool_calls"})

Outcome = Literal["hit", "miss", "error", "off"]


@dataclass(slots=True)
class Lookup:
    """What the cache said about one request, and what a miss needs to be stored later."""

    plan: CachePlan
    #: The model the plan's key was made for: only its own answers are stored (not a fallback's).
    model: str = ""
    outcome: Outcome = "off"
    entry: CacheEntry | None = None
    similarity: float | None = None
    #: Semantic rules: the last user turn's embedding (None when it could not be computed).
    vector: list[float] | None = None

    @property
    def header(self) -> str:
        """The ``x-switchyard-cache`` value: ``hit|miss|error|off; rule=…; mode=…[; similarity=…]``."""
        parts = [self.outcome if self.plan.read else "bypass", f"rule={self.plan.label}", f"mode={self.plan.mode}"]
        if self.similarity is not None:
            parts.append(f"similarity={self.similarity:.3f}")
        if not self.plan.write:
            parts.append("store=no")
        return "; ".join(parts)


class _Answer(msgspec.Struct):
    choices: list[dict[str, Any]] = []
    usage: dict[str, Any] | None = None
    object: str | None = None
    data: list[Any] = []


def _complete(answer: bytes) -> tuple[int, int] | None:
    """Prompt and completion tokens of a complete answer worth storing, else None."""
    try:
        data = msgspec.json.decode(answer, type=_Answer)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if data.object == "list" and data.data and data.usage is not None:  # an embeddings answer: no output tokens
        prompt = data.usage.get("prompt_tokens")
        return (prompt, 0) if isinstance(prompt, int) else None
    if not data.choices or data.usage is None or any(c.get("finish_reason") not in COMPLETE for c in data.choices):
        return None
    prompt, completion = data.usage.get("prompt_tokens"), data.usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion


class CacheRunner:
    """Looks requests up in the response cache and stores complete answers (one per gateway process).

    Args:
        cache: The backend.
        classifiers: Where semantic lookups get their embeddings (called when needed: it exists only
            inside the app's lifespan).
        metrics: Lookups and stores are counted there.
        spawn: Runs a store in the background (the answer has been sent by then).
    """

    def __init__(self, cache: ResponseCache, classifiers: Callable[[], ClassifierRunner], metrics: GatewayMetrics,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.cache = cache
        self._classifiers = classifiers
        self.metrics = metrics
        self._spawn = spawn

    async def lookup(self, snapshot: PolicySnapshot, plan: CachePlan, tenant: str, model: str) -> Lookup:
        """The cached answer for ``plan`` (made for ``model``) if there is one (``outcome``: hit, miss or error)."""
        found = Lookup(plan, model)
        owner = tenant if plan.scope != "global" else None
        rule = plan.label
        try:
            if plan.mode == "semantic":
                found.vector = await self._embedding(snapshot, plan)
                if found.vector is not None and plan.read:
                    near = await self.cache.nearest(rule, plan.context, found.vector, plan.rule.min_similarity or 1.0,
                                                    owner)
                    if near is not None:
                        found.entry, found.similarity = near
            elif plan.read:
                found.entry = await self.cache.get(rule, plan.key, owner)
        except Exception as exc:  # a failing cache is a miss, never a failed request
            log.warning("response cache lookup (%s) failed: %s", rule, exc)
            found.outcome = "error"
        else:
            if plan.mode == "semantic" and found.vector is None:
                found.outcome = "error"
            elif plan.read:
                found.outcome = "hit" if found.entry is not None else "miss"
        if plan.read:
            self.metrics.cache_lookups_by(rule, plan.mode, found.outcome).inc()
        return found

    async def _embedding(self, snapshot: PolicySnapshot, plan: CachePlan) -> list[float] | None:
        pool = snapshot.pools.get(plan.rule.embedding_pool or "")
        if pool is None or plan.text is None:
            return None
        try:
            return await self._classifiers().embed(pool, plan.text, EMBED_TIMEOUT_S)
        except (ClassifierError, TimeoutError) as exc:
            log.debug("no embedding for cache rule %s: %s", plan.label, exc)
            return None

    @staticmethod
    def wants(found: Lookup | None, served_by: str) -> bool:
        """Whether an answer of model ``served_by`` to a request looked up as ``found`` is to be stored."""
        return (found is not None and found.plan.write and served_by == found.model
                and (found.plan.mode == "exact" or found.vector is not None))

    def store_answer(self, found: Lookup, tenant: str, answer: bytes) -> None:
        """Store a miss's complete answer in the background (a non-streamed body)."""
        self._spawn(self._store(found, tenant, answer))

    def store_stream(self, found: Lookup, kind: Literal["chat", "completion"], tenant: str, sse: bytes | None) -> None:
        """Store a miss's completed stream (assembled into the complete answer) in the background."""
        answer = assemble(kind, sse) if sse is not None else None
        if answer is None:  # broken, cut short, an error event, or longer than could be kept
            self.metrics.cache_stores.labels(found.plan.label, found.plan.mode, "incomplete").inc()
            return
        self.store_answer(found, tenant, answer)

    async def _store(self, found: Lookup, tenant: str, answer: bytes) -> None:
        plan = found.plan
        rule = plan.rule
        counts = self.metrics.cache_stores
        if len(answer) > rule.max_entry_bytes:
            counts.labels(plan.label, plan.mode, "too_large").inc()
            return
        tokens = _complete(answer)
        if tokens is None:
            counts.labels(plan.label, plan.mode, "incomplete").inc()
            return
        entry = CacheEntry(body=answer, model=found.model, tenant=tenant if plan.scope != "global" else None,
                           rule=plan.label, created=time.time(), prompt_tokens=tokens[0], completion_tokens=tokens[1])
        try:
            stored = await self.cache.put(plan.label, plan.key, entry, rule.ttl, rule.max_entries)
            if stored and found.vector is not None:
                await self.cache.put_vector(plan.label, plan.context, plan.key, found.vector, rule.ttl,
                                            rule.max_entries)
        except Exception as exc:  # a failing cache loses an entry, nothing else
            log.warning("response cache store (%s) failed: %s", plan.label, exc)
            counts.labels(plan.label, plan.mode, "error").inc()
            return
        counts.labels(plan.label, plan.mode, "stored" if stored else "too_large").inc()

    def hit_response(self, kind: str, body: dict[str, Any], found: Lookup,
                     headers: dict[str, str]) -> Response[bytes]:
        """The answer to a hit: the cached answer, or its SSE replay for a streaming client."""
        assert found.entry is not None
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            return Response(replay(stream_kind(kind), found.entry.body, include_usage=usage), status_code=200,
                            media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        return Response(for_client(found.entry.body), status_code=200, media_type="application/json", headers=headers)

    async def refresh_gauges(self) -> None:
        """Copy the backend's entry, byte and eviction counts into the gauges."""
        stats = await self.cache.stats()
        self.metrics.cache_entries.set(stats.entries)
        self.metrics.cache_bytes.set(stats.bytes)
        for reason, count in stats.evictions.items():
            self.metrics.cache_evictions.labels(reason).set(count)
