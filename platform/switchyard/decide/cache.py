"""Which response-cache rule a request falls under, and the keys it is cached by.

Pure: no I/O, no clock. The gateway asks :func:`plan_cache` once per request (after the model
is resolved); the store (``switchyard.store.cache``) keeps the answers under the plan's keys.

**Keys.** :func:`canonical_request` encodes everything that changes the answer, as sorted-key
compact JSON, so key order and whitespace of the client's body never matter and ``0`` equals
``0.0``. The model in the key is the *resolved* one: ``auto`` routed to ``small`` and ``small``
asked for directly share entries. A parameter left out and the same parameter given with its
default value are *different* keys (the encoding does not know every engine's defaults, and
guessing one wrong would serve a wrong answer); a parameter given as ``null`` counts as left out.
Keys also bind the rule and the scope (``tenant:<id>`` or ``global``), so a tenant-scoped entry
can only be found by the tenant that stored it.

**Semantic context.** A semantic rule matches the last user turn by meaning, within a *context*:
the hash of the whole request with that turn's text taken out. Two requests are neighbours only
if everything else is identical: model, parameters, system prompt, earlier turns, and any
non-text parts (images) of the last user turn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from switchyard.api.headers import CACHE_CONTROL_HEADER
from switchyard.decide.admit import spend_of
from switchyard.policy.cache_rules import CacheRule
from switchyard.policy.fleet import Model
from switchyard.policy.snapshot import PolicySnapshot

#: Tokens of :data:`CACHE_CONTROL_HEADER` and what each turns off: (read, write).
_CONTROL_TOKENS: dict[str, tuple[bool, bool]] = {
    "no-cache": (False, True),
    "no-store": (True, False),
    "bypass": (False, False),
}

#: Body keys that never change the answer, left out of the key (plus any key starting with ``x-``).
IGNORED_KEYS = frozenset({
    "stream", "stream_options", "user", "priority", "metadata", "store", "service_tier", "request_id",
})

#: Body keys encoded on their own (the model is replaced by the resolved one).
_STRUCTURAL_KEYS = frozenset({"model", "messages", "prompt", "input"})

#: What a request asks for, by the endpoint it came to: ``/v1/chat/completions``, ``/v1/completions``,
#: ``/v1/embeddings``, ``/v1/responses``, and ``/tokenize`` or ``/detokenize`` (which compute nothing on a GPU).
RequestKind = Literal["chat", "completion", "embedding", "responses", "tokenize", "detokenize"]
#: The kinds a model of kind ``generate`` serves; an embedding model serves ``embedding`` (both: the tokenizer).
GENERATING_KINDS = frozenset({"chat", "completion", "responses"})
#: The kinds that only use a model's tokenizer: no limits charged, no queue, never cached.
TOKENIZER_KINDS = frozenset({"tokenize", "detokenize"})


class BadCacheControl(ValueError):
    """The cache-control header holds a token this gateway does not know."""


def parse_cache_control(value: str | None) -> tuple[bool, bool]:
    """Whether the request may be answered from the cache and whether its answer may be stored.

    ``value``: the :data:`CACHE_CONTROL_HEADER` header, comma-separated tokens, case-insensitive:
    ``no-cache`` (do not read), ``no-store`` (do not write), ``bypass`` (neither). Absent or empty
    reads and writes.

    Raises:
        BadCacheControl: a token is not one of those three.
    """
    read = write = True
    for raw in (value or "").split(","):
        token = raw.strip().lower()
        if not token:
            continue
        allowed = _CONTROL_TOKENS.get(token)
        if allowed is None:
            raise BadCacheControl(
                f"{CACHE_CONTROL_HEADER}: unknown token {raw.strip()!r}; allowed (comma-separated, "
                f"case-insensitive): {', '.join(_CONTROL_TOKENS)}")
        read, write = read and allowed[0], write and allowed[1]
    return read, write


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_deterministic(body: Mapping[str, Any], kind: RequestKind = "chat") -> bool:
    """Whether the request asks for a reproducible answer: ``temperature`` 0 or an integer ``seed``; an
    embedding always is (nothing is sampled).

    A missing temperature is not deterministic: OpenAI's default is 1.
    """
    if kind == "embedding":
        return True
    temperature = body.get("temperature")
    seed = body.get("seed")
    return (_is_number(temperature) and temperature == 0) or (isinstance(seed, int) and not isinstance(seed, bool))


def _normal(value: Any) -> Any:
    """``value`` with integral floats as ints (``0.0`` is ``0``), recursively."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def _message(message: Any) -> Any:
    """A chat message for the key: every field but those set to ``null``, content parts in order."""
    if not isinstance(message, Mapping):
        return _normal(message)
    return {str(k): _normal(v) for k, v in message.items() if v is not None}


def _parameters(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's parameters that change the answer (``stop`` as a list)."""
    params: dict[str, Any] = {}
    for key, value in body.items():
        if (value is None or key in _STRUCTURAL_KEYS or key in IGNORED_KEYS
                or key.lower().startswith("x-")):
            continue
        params[key] = [value] if key == "stop" and isinstance(value, str) else _normal(value)
    return params


#: Compact JSON with sorted keys, text as UTF-8 (about a fifth of ``json.dumps``'s time, on every request).
_CANONICAL = msgspec.json.Encoder(order="sorted")


def _encode(doc: Mapping[str, Any]) -> bytes:
    try:
        return _CANONICAL.encode(doc)
    except (OverflowError, TypeError, msgspec.EncodeError):  # an integer beyond 64 bits (a client's): JSON's own
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _content(kind: RequestKind, body: Mapping[str, Any]) -> dict[str, Any]:
    """What a request's canonical document holds besides its kind and model: its parameters, and its messages,
    input or prompt (normalised: the Python work of a key)."""
    doc: dict[str, Any] = {"params": _parameters(body)}
    if kind == "chat":
        doc["messages"] = [_message(m) for m in body.get("messages") or []]
    elif kind in ("embedding", "responses"):
        doc["input"] = _normal(body.get("input"))
    else:
        doc["prompt"] = _normal(body.get("prompt"))
    return doc


def _document(kind: RequestKind, model: str, body: Mapping[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "model": model, **_content(kind, body)}


class CanonicalRequest:
    """One request's :func:`canonical_request`, normalised once and encoded for each model it is asked for: the
    model as asked (the request log's :meth:`digest`) and the resolved one (a cache key). The gateway makes one per
    request and hands it to the decision procedure (``Ask.canonical``), so that its body is walked once."""

    __slots__ = ("_content", "body", "kind")

    def __init__(self, kind: RequestKind, body: Mapping[str, Any]) -> None:
        self.kind, self.body = kind, body
        self._content: dict[str, Any] | None = None

    def encode(self, model: str) -> bytes:
        """:func:`canonical_request` of the request for ``model``."""
        if self._content is None:
            self._content = _content(self.kind, self.body)
        return _encode({"kind": self.kind, "model": model, **self._content})

    def digest(self) -> str:
        """:func:`request_digest` of the request."""
        model = self.body.get("model")
        return hashlib.sha256(self.encode(model if isinstance(model, str) else "")).hexdigest()[:16]


def canonical_request(kind: RequestKind, model: str, body: Mapping[str, Any]) -> bytes:
    """The canonical encoding of everything in a request that changes its answer.

    ``model`` is the resolved model (``body["model"]`` is not read). See the module docstring for
    what is equal and what is not.
    """
    return CanonicalRequest(kind, body).encode(model)


def request_digest(kind: RequestKind, body: Mapping[str, Any]) -> str:
    """A short fingerprint of a request: equal for requests the cache would answer alike.

    64 bits of SHA-256 over :func:`canonical_request` with the model as asked. The request log
    keeps it (never the text) so that a replay of the log knows which requests repeated.
    """
    return CanonicalRequest(kind, body).digest()


def _last_user(messages: Any) -> int | None:
    """The index of the last ``user`` message, or None."""
    if not isinstance(messages, list):
        return None
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, Mapping) and m.get("role") == "user":
            return i
    return None


def _text_parts(content: Any) -> tuple[str | None, Any]:
    """The text of a message content (parts joined by newlines), and what is left without it."""
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        return None, content
    texts, rest = [], []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            rest.append(part)
    return ("\n".join(texts) if texts else None), rest


def semantic_split(kind: RequestKind, model: str, body: Mapping[str, Any]) -> tuple[bytes, str] | None:
    """The request without its last user turn's text (canonical), and that text.

    None when there is no such text: no user message, or one without text (completions: the
    prompt is not a string), or only whitespace. Non-text parts of that turn stay in the context.
    """
    if kind == "embedding":
        return None  # an embedding is of its input as a whole: no turn to match by meaning
    doc = _document(kind, model, body)
    if kind == "completion":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            return None
        del doc["prompt"]
        return _encode(doc), prompt
    index = _last_user(body.get("messages"))
    if index is None:
        return None
    text, rest = _text_parts(body["messages"][index].get("content"))
    if text is None or not text.strip():
        return None
    message = doc["messages"][index]
    message.pop("content", None)
    if rest:
        message["content_without_text"] = _normal(rest)
    return _encode(doc), text


@dataclass(frozen=True, slots=True)
class CachePlan:
    """How one request uses the response cache.

    Attributes:
        rule: The rule that applies.
        label: Its name, or ``cache[<index>]``.
        mode: ``exact`` or ``semantic``.
        scope: ``tenant:<tenant id>`` or ``global``.
        key: Hex SHA-256 of label, scope and :func:`canonical_request`; the entry's key.
        context: Semantic rules: hex SHA-256 of label, scope and the request without the last user
            turn's text (see :func:`semantic_split`); ``""`` for exact rules.
        text: Semantic rules: the last user turn's text, to embed; None for exact rules.
        read: Look the answer up.
        write: Store the answer.
        trace: One line on what applies and why.
    """

    rule: CacheRule
    label: str
    mode: Literal["exact", "semantic"]
    scope: str
    key: str
    context: str
    text: str | None
    read: bool
    write: bool
    trace: str


def _digest(purpose: str, label: str, scope: str, canonical: bytes) -> str:
    head = _CANONICAL.encode([purpose, label, scope])
    return hashlib.sha256(head + b"\n" + canonical).hexdigest()


def _skip_reason(rule: CacheRule, model: str, route: str | None, tier: str, deterministic: bool) -> str | None:
    """Why ``rule`` does not apply, judged on its match alone (None: it applies so far)."""
    match = rule.match
    if match.models is not None and model not in match.models:
        return f"model {model}"
    if match.routes is not None and (route is None or route not in match.routes):
        return "no route" if route is None else f"route {route}"
    if match.tiers is not None and tier not in match.tiers:
        return f"tier {tier}"
    if not deterministic and not match.nondeterministic:
        return "not deterministic"
    return None


def _usage(read: bool, write: bool) -> str:
    if read and write:
        return "lookup and store"
    return "lookup only (client: no-store)" if read else "store only (client: no-cache)"


def plan_cache(snapshot: PolicySnapshot, *, kind: RequestKind, model: str, route: str | None, tier: str,
               tenant: str, body: Mapping[str, Any], read: bool = True, write: bool = True,
               canonical: CanonicalRequest | None = None) -> CachePlan | None:
    """The cache plan of a request: the first rule, in document order, that applies to it.

    Args:
        snapshot: The active policy.
        kind: ``chat`` or ``completion``.
        model: The resolved model.
        route: The route the client asked for, or None when it named a model directly.
        tier: The tenant's tier.
        tenant: The tenant's id (the scope of ``tenant`` rules).
        body: The validated request body.
        read, write: What the client allows (:func:`parse_cache_control`).
        canonical: The request's :class:`CanonicalRequest`, when its executor made one (None: made here).

    A rule applies when its ``models``, ``routes`` and ``tiers`` (absent: any) admit the request
    and the request is deterministic (:func:`is_deterministic`) unless the rule caches
    nondeterministic requests too; a semantic rule also needs a last user turn with text. Requests
    for more than one choice (``n`` > 1) are never cached. None when no rule applies or the client
    allows neither reading nor writing.
    """
    if not (read or write) or kind not in ("chat", "completion", "embedding"):
        return None  # (a Responses API answer names a stored response by its id: never served from a cache)
    n = body.get("n")
    if isinstance(n, int | float) and not isinstance(n, bool) and n > 1:
        return None
    deterministic = is_deterministic(body, kind)
    skipped: list[str] = []
    encoded: bytes | None = None
    for index, rule in enumerate(snapshot.document.cache):
        label = rule.name or f"cache[{index}]"
        reason = _skip_reason(rule, model, route, tier, deterministic)
        split = None
        if reason is None and rule.mode == "semantic":
            split = semantic_split(kind, model, body)
            if split is None:
                reason = "no user text for semantic match"
        if reason is not None:
            skipped.append(f"{label} ({reason})")
            continue
        scope = f"tenant:{tenant}" if rule.scope == "tenant" else "global"
        if encoded is None:
            encoded = (canonical or CanonicalRequest(kind, body)).encode(model)
        trace = f"cache rule {label} ({rule.mode}, {rule.scope}): {_usage(read, write)}"
        if skipped:
            trace += f"; skipped {', '.join(skipped)}"
        return CachePlan(
            rule=rule, label=label, mode=rule.mode, scope=scope,
            key=_digest("key", label, scope, encoded),
            context="" if split is None else _digest("context", label, scope, split[0]),
            text=None if split is None else split[1],
            read=read, write=write, trace=trace,
        )
    return None


def hit_charge(rule: CacheRule, model: Model, prompt_tokens: int, completion_tokens: int) -> tuple[int, float]:
    """What a hit of ``rule`` is charged for a cached answer of ``prompt_tokens`` and ``completion_tokens``: the
    rule's ``hit_charge`` share of its tokens and of its price at ``model``'s rates."""
    share = rule.hit_charge
    return round(share * (prompt_tokens + completion_tokens)), share * spend_of(model, prompt_tokens, completion_tokens)
