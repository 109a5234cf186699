"""What the OpenAPI document says of the admin JSON API's routes (``/admin/api``): request bodies and
answers, built from the shared pieces of :mod:`switchyard.api.openapi` (which also holds the admin API's
error object and :func:`~switchyard.api.openapi.admin_operation`). The bounds of an author and a region
are the store's.
"""

from __future__ import annotations

from litestar.openapi.spec import OpenAPIFormat, OpenAPIMediaType, OpenAPIType, RequestBody, Schema

from switchyard.api.openapi import (
    ANY_OBJECT,
    BOOLEAN,
    DATE_TIME,
    INTEGER,
    ISSUE,
    NUMBER,
    STRING,
    array,
    json_request_body,
    json_response,
    nullable,
    obj,
)
from switchyard.store.policy_versions import MAX_AUTHOR
from switchyard.store.regions import REGION_PATTERN

# --- /admin/api/endpoints -----------------------------------------------------------------------

_BREAKER = obj({"state": Schema(type=OpenAPIType.STRING, enum=["closed", "open", "half_open"]),
                "reopens_in_s": nullable(OpenAPIType.NUMBER), "consecutive_failures": INTEGER,
                "window": obj({"ok": INTEGER, "failed": INTEGER}, ["ok", "failed"]),
                "trials_in_flight": nullable(OpenAPIType.INTEGER), "last_reason": nullable(OpenAPIType.STRING)},
               ["state", "consecutive_failures", "window"])
_KV_EVENTS = obj({
    "state": Schema(type=OpenAPIType.STRING, enum=["live", "stale", "syncing", "disconnected"],
                    description="live: routed on; stale: requests went without events (the approximate index "
                    "routes); syncing: reading the engine's history or filling a gap; disconnected: no connection"),
    "events_url": STRING, "blocks": INTEGER, "block_size": nullable(OpenAPIType.INTEGER),
    "last_seq": nullable(OpenAPIType.INTEGER), "batches": INTEGER, "events": INTEGER, "gaps": INTEGER,
    "gaps_recovered": INTEGER, "restarts": INTEGER, "orphans": INTEGER,
    "digest": Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], description="A digest of the blocks held, "
                     "named by their token chains: equal on every gateway process that read the same stream"),
    "last_event_age_s": nullable(OpenAPIType.NUMBER), "reason": nullable(OpenAPIType.STRING)},
    ["state", "blocks", "last_seq", "gaps_recovered"], nullable_=True,
    description="The endpoint's KV-cache event stream as this gateway process follows it (null: its pool "
    "declares no kv_events).")
ENDPOINTS = obj({
    "policy": STRING,
    "endpoints": array(obj({"url": STRING, "pool": STRING, "region": STRING, "healthy": BOOLEAN, "up": BOOLEAN,
                            "failure": nullable(OpenAPIType.STRING), "down_for_s": nullable(OpenAPIType.NUMBER),
                            "probe_streak": INTEGER, "breaker": _BREAKER, "in_flight": INTEGER,
                            "load": nullable(OpenAPIType.NUMBER), "scrape": ANY_OBJECT, "kv_events": _KV_EVENTS},
                           ["url", "pool", "region", "healthy", "up", "breaker", "in_flight", "scrape"])),
    "pools": array(obj({"pool": STRING, "region": STRING, "breaker": _BREAKER}, ["pool", "region", "breaker"])),
}, ["policy", "endpoints", "pools"])

KV_LOOKUP_BODY = json_request_body(obj(
    {"model": STRING, "messages": Schema(type=OpenAPIType.ARRAY), "prompt": Schema(),
     "tools": Schema(type=OpenAPIType.ARRAY)}, ["model"],
    description="A request body as for /v1/chat/completions (messages) or /v1/completions (prompt)."))
KV_LOOKUP = obj({
    "model": STRING,
    "prompt_tokens": Schema(type=[OpenAPIType.INTEGER, OpenAPIType.NULL], description="null: the model declares no "
                            "tokenizer, or the request cannot be rendered exactly"),
    "renders": BOOLEAN,
    "endpoints": array(obj({"url": STRING, "pool": STRING, "state": STRING,
                            "cached_tokens": nullable(OpenAPIType.INTEGER)},
                           ["url", "pool", "state", "cached_tokens"])),
}, ["model", "prompt_tokens", "renders", "endpoints"])

# --- the policy ---------------------------------------------------------------------------------

VERSION_FIELDS: dict[str, Schema] = {
    "number": INTEGER, "sha256": STRING, "parent": nullable(OpenAPIType.INTEGER), "active": BOOLEAN,
    "created_at": DATE_TIME, "author": STRING, "source": STRING, "message": STRING,
}
VERSION = obj(VERSION_FIELDS, list(VERSION_FIELDS), description="A policy version's metadata.")
VERSION_WITH_TEXT = obj({**VERSION_FIELDS, "text": STRING}, [*VERSION_FIELDS, "text"])
POLICY = obj({
    "policy_source": Schema(type=OpenAPIType.STRING, enum=["file", "db"]),
    "version": VERSION, "text": STRING,
    "serving": obj({"version": STRING, "sha256": STRING}, ["version", "sha256"]),
    "file": obj({"path": STRING, "sha256": nullable(OpenAPIType.STRING), "error": nullable(OpenAPIType.STRING)},
                nullable_=True),
    "matches_file": nullable(OpenAPIType.BOOLEAN),
    "rejected": obj({"source": nullable(OpenAPIType.STRING), "issues": array(ISSUE)}, nullable_=True),
}, ["policy_source", "version", "text", "serving", "file", "matches_file", "rejected"])
VERSIONS = obj({"versions": array(VERSION)}, ["versions"])
DIFF = obj({"from": STRING, "to": STRING, "semantic": BOOLEAN, "changes": array(STRING), "unified": STRING},
           ["from", "to", "semantic", "changes", "unified"])
VALIDATION = obj({"valid": BOOLEAN, "issues": array(ISSUE), "sha256": STRING,
                  "changes_from_active": Schema(type=[OpenAPIType.ARRAY, OpenAPIType.NULL], items=STRING),
                  # A valid document's located warnings (a route rule a tier allowed to call it can never take).
                  "warnings": array(ISSUE)},
                 ["valid", "issues"])
WRITTEN = obj({"created": BOOLEAN, "version": VERSION}, ["created", "version"])
WRITTEN_RESPONSES = {201: json_response("A new version is active (this process serves it already).", WRITTEN),
                     200: json_response("That content was already active: nothing new.", WRITTEN)}
EVENTS = obj({"events": array(obj({"id": INTEGER, "at": DATE_TIME, "actor": STRING, "origin": STRING,
                                   "action": STRING, "target": STRING, "detail": ANY_OBJECT},
                                  ["id", "at", "actor", "origin", "action", "target", "detail"]))}, ["events"])

_YAML = Schema(type=OpenAPIType.STRING, description="The policy document (YAML).")
VALIDATE_BODY = RequestBody(description="The document (an empty body is an empty, invalid document).", content={
    "application/json": OpenAPIMediaType(schema=obj({"yaml": _YAML}, ["yaml"], extra=False)),
    "application/yaml": OpenAPIMediaType(schema=Schema(description="The policy document (any YAML: what is not a "
                                                                   "policy is answered valid: false).")),
    "text/plain": OpenAPIMediaType(schema=_YAML),
})
AUTHOR = Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], max_length=MAX_AUTHOR,
                description="Who (for the audit log); default api.")
#: (``store.policy_versions``' limit of a version's message.)
MESSAGE = Schema(type=OpenAPIType.STRING, max_length=1000)
PUBLISH_BODY = json_request_body(obj({"yaml": _YAML, "message": MESSAGE, "author": AUTHOR}, ["yaml"],
                                     extra=False))

# --- usage, limits, regions, audit ----------------------------------------------------------------

_COUNTS: dict[str, Schema] = {"requests": INTEGER, "prompt_tokens": INTEGER, "completion_tokens": INTEGER,
                              "cached_tokens": INTEGER, "spend": NUMBER}
USAGE = obj({"rows": array(obj({**_COUNTS, "tenant": STRING, "key_id": INTEGER, "model": STRING,
                                "day": Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.DATE)},
                               ["tenant", "key_id", "model", "day"])),
             "totals": obj(_COUNTS)}, ["rows", "totals"])
LIMITS = obj({"limits": obj({}, nullable_=True, description="The override, as validated (null: none).")},
             ["limits"])
_PER = Schema(type=[OpenAPIType.INTEGER, OpenAPIType.NULL], minimum=1)
LIMITS_BODY = json_request_body(obj({
    "limits": obj({"tokens_per_minute": _PER, "requests_per_minute": _PER, "tokens_per_day": _PER,
                   "spend_per_month": Schema(type=[OpenAPIType.NUMBER, OpenAPIType.NULL], exclusive_minimum=0)},
                  extra=False, nullable_=True,
                  description="The shape of a tier's limits in the policy (a null field lifts that limit; "
                              "tokens_per_minute at most tokens_per_day); null clears the override."),
    "author": AUTHOR}, ["limits"], extra=False))
REGION_BODY = json_request_body(obj({
    "region": Schema(type=[OpenAPIType.STRING, OpenAPIType.NULL], pattern=REGION_PATTERN,
                     description="A region name (it need not be in the active policy), or null for none."),
    "author": AUTHOR}, ["region"], extra=False))
TENANT_REGION = obj({"region": nullable(OpenAPIType.STRING)}, ["region"])
KEY_REGION = obj({"region": nullable(OpenAPIType.STRING), "home_region": nullable(OpenAPIType.STRING)},
                 ["region", "home_region"])

# --- the response cache ---------------------------------------------------------------------------

CACHE = obj({"backend": Schema(type=OpenAPIType.STRING, enum=["memory", "redis"]), "entries": INTEGER,
             "bytes": INTEGER, "evictions": obj({}, extra=True), "rules": array(STRING)},
            ["backend", "entries", "bytes", "evictions", "rules"])
PURGE_BODY = json_request_body(obj({"tenant": nullable(OpenAPIType.STRING), "model": nullable(OpenAPIType.STRING),
                                    "author": AUTHOR}, extra=False))
PURGED = obj({"purged": INTEGER, "tenant": nullable(OpenAPIType.STRING), "model": nullable(OpenAPIType.STRING)},
             ["purged", "tenant", "model"])

# --- recent activity ------------------------------------------------------------------------------

ACTIVITY = obj({"window_s": INTEGER, "point_s": INTEGER, "since": STRING, "now": STRING, "pools": array(ANY_OBJECT),
                "total": ANY_OBJECT}, ["window_s", "point_s", "since", "now", "pools", "total"])
REQUEST = obj({"time": STRING, "request_id": STRING, "kind": STRING, "status": nullable(OpenAPIType.INTEGER),
               "trace": array(STRING)}, ["time", "request_id", "kind", "status", "trace"])
REQUESTS = obj({"requests": array(REQUEST)}, ["requests"])
