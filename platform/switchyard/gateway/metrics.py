"""The gateway's Prometheus metrics (one registry per app, so tests can build many apps).

Labels are bounded by the policy (model, pool names) and by HTTP status codes; tenant ids and
keys never appear in labels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)

_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 1.5, 2.5, 5, 10, 30, 60, 300, 600)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
#: Event-loop lag: how late a timer fired (the gateway's own added latency is in this range).
LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_CLASSIFIER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Children(Generic[M]):
    """A labelled metric's children by their label values, each bound once: ``children(*values)`` is
    ``metric.labels(*values)`` without prometheus_client's checks, conversions and lock on every call (the hot path
    counts seven of them a request). Label values are bounded by the policy, as the metric's own children are."""

    __slots__ = ("_labels", "_made")

    def __init__(self, metric: M) -> None:
        self._labels: Callable[..., M] = metric.labels
        self._made: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._made.get(values)
        if child is None:
            child = self._made[values] = self._labels(*values)
        return child


class GatewayMetrics:
    """Counters and histograms the gateway updates on every request."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "switchyard_requests", "Requests answered, by resolved model, pool, HTTP status, tier, priority "
            "class, region served in and outcome (ok, refused, limited, shed, error, client_closed).",
            ["model", "pool", "status", "tier", "class", "region", "outcome"], registry=self.registry)
        self.limited = Counter(
            "switchyard_limited", "Requests refused with 429 by a token budget or rate limit, by limit "
            "(tokens_per_minute, requests_per_minute, tokens_per_day, spend_per_month) and the request's tier.",
            ["limit", "tier"], registry=self.registry)
        self.duration = Histogram(
            "switchyard_request_duration_seconds",
            "Time from the request's arrival to its last byte, by model and pool.",
            ["model", "pool"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.first_byte = Histogram(
            "switchyard_time_to_first_byte_seconds",
            "Time from the request's arrival to the engine's first byte, by model and pool.",
            ["model", "pool"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge(
            "switchyard_upstream_in_flight", "Requests in flight at each pool's engines.",
            ["pool"], registry=self.registry)
        self.attempts = Counter(
            "switchyard_upstream_attempts",
            "Requests sent to engines, by pool and outcome (ok, connect_error, timeout, first_token_timeout, "
            "broken, body_error, body_timeout, invalid_response, or the engine's HTTP status); a request that fell "
            "back counts once "
            "per try.",
            ["pool", "outcome"], registry=self.registry)
        self.policy_info = Gauge(
            "switchyard_policy_info", "The active policy: 1 for its version and hash.",
            ["version", "sha256"], registry=self.registry)
        self.tokens = Counter(
            "switchyard_tokens", "Tokens used by answered requests, by the model that served them and kind "
            "(prompt, completion, cached: the prompt tokens the engine found in its prefix cache).",
            ["model", "kind"], registry=self.registry)
        self.spend = Counter(
            "switchyard_spend", "What answered requests cost at their model's prices (the policy's currency).",
            ["model"], registry=self.registry)
        self.loop_lag = Histogram(
            "switchyard_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 10 ms: time spent on other work (a long callback, a "
            "garbage collection, the process not scheduled) before it could look. Every request waiting on the "
            "loop then waited as long.", buckets=LOOP_LAG_BUCKETS, registry=self.registry)
        self.gc_pause = Histogram(
            "switchyard_gc_pause_seconds",
            "Garbage collections of this process and how long each held the interpreter, by generation (0, 1, 2: "
            "2 is a full collection). The event loop stops for as long.",
            ["generation"], buckets=LOOP_LAG_BUCKETS, registry=self.registry)
        self._usage_children: dict[str, tuple[Counter, Counter, Counter, Counter]] = {}
        self.policy_version = Gauge(
            "switchyard_policy_active_version", "The number of the policy version this process serves "
            "(0 for an unversioned document).", registry=self.registry)
        self.canary_requests = Counter(
            "switchyard_canary_requests", "Requests of a running policy canary's scope, by their part in it: "
            "decided by the candidate (canary), by the active version (control), or by the active version with "
            "the candidate deciding alongside (shadow).", ["role"], registry=self.registry)
        self.canary_differences = Counter(
            "switchyard_canary_shadow_differences", "Shadow requests the candidate would have decided otherwise, "
            "by what differed.", ["field"], registry=self.registry)
        self.canary_percent = Gauge(
            "switchyard_canary_slice_ratio", "The share of its scope a running policy canary takes, 0 to 1 (0: none "
            "runs).",
            registry=self.registry)
        self.reload_failures = Counter(
            "switchyard_policy_reload_failures", "Policy documents rejected by a reload, by where they came "
            "from (file, database); the last good version kept serving.", ["source"], registry=self.registry)

        self.queue_depth = Gauge(
            "switchyard_queue_depth", "Requests waiting in the gateway's queues, by pool, lane and class (a "
            "request waits in the queue of every pool of its model).", ["pool", "lane", "class"],
            registry=self.registry)
        self.queue_wait = Histogram(
            "switchyard_queue_wait_seconds", "How long dispatched requests waited in the gateway's queue, by the "
            "pool that granted them, lane and class.", ["pool", "lane", "class"], buckets=_QUEUE_BUCKETS,
            registry=self.registry)
        self.shed = Counter(
            "switchyard_shed", "Requests refused with 503 by flow control, by class and reason (utilisation: "
            "above the class's shedding threshold; deadline: waited its class's max_queue_ms; predicted_wait: "
            "its predicted wait exceeded the deadline on arrival; lane_full: a batch line found its batch lane's "
            "waiting room full).", ["class", "reason"], registry=self.registry)
        self.downgrades = Counter(
            "switchyard_downgrades", "Requests served by a cheaper model because the requested one's pools were "
            "saturated, by class, reason and the model asked for.", ["class", "reason", "model"],
            registry=self.registry)
        self.queue_left = Counter(
            "switchyard_queue_abandoned", "Requests whose client went away while they waited in the queue, by "
            "class.", ["class"], registry=self.registry)
        self.preemptions = Counter(
            "switchyard_preemptions", "Batch-lane requests in flight that flow control cancelled for an interactive "
            "request, to make room or because they were still waiting for their first engine step (each queued "
            "again), by pool.",
            ["pool"], registry=self.registry)
        self.utilisation = Gauge(
            "switchyard_pool_utilisation", "Utilisation of each pool's least-loaded endpoint as flow control "
            "sees it (1 = saturated), for pools that served a request since start-up.", ["pool"],
            registry=self.registry)
        self.classifier_outcomes = Counter(
            "switchyard_classifier", "Classifier calls that reach out (embedding classifiers), by classifier and "
            "outcome (yes, no: the score against the threshold; error, timeout: no score, the rule did not match).",
            ["classifier", "outcome"], registry=self.registry)
        self.classifier_seconds = Histogram(
            "switchyard_classifier_seconds", "How long a classifier call took (whatever its outcome), by classifier.",
            ["classifier"], buckets=_CLASSIFIER_BUCKETS, registry=self.registry)

        # Resilience: health, breakers, fallbacks, the retry budget, dependencies.
        self.endpoint_up = Gauge(
            "switchyard_endpoint_up", "1 while an endpoint is in service by its health (probes and refused "
            "connections), 0 while it is out.", ["pool", "endpoint"], registry=self.registry)
        self.breaker_state = Gauge(
            "switchyard_breaker_state", "Circuit breaker state (0 closed, 1 half-open, 2 open), by scope (endpoint, "
            "pool) and name (the endpoint URL or the pool name).", ["scope", "name"], registry=self.registry)
        self.breaker_transitions = Counter(
            "switchyard_breaker_transitions", "Circuit breaker state changes, by scope, name and the state entered.",
            ["scope", "name", "to"], registry=self.registry)
        self.fallbacks = Counter(
            "switchyard_fallbacks", "Requests that moved on from an endpoint or stage before their first byte, by "
            "the model asked for and why (unavailable: no endpoint of a stage in service, its breakers open or "
            "its health probes failing; otherwise the failed try's outcome as in switchyard_upstream_attempts).",
            ["model", "reason"], registry=self.registry)
        self.streams_broken = Counter(
            "switchyard_streams_broken", "Streams whose engine broke them off after their first byte (connection "
            "lost, an error event, a stall), by pool; whether they were resumed is switchyard_stream_resumes.",
            ["pool"], registry=self.registry)
        self.adapter_loads = Counter(
            "switchyard_adapter_loads", "LoRA adapters the gateway loaded on an engine before sending it a request "
            "(pools with runtime_lora_loading), by pool, model and outcome: loaded, already (the engine had it) or "
            "failed.", ["pool", "model", "outcome"], registry=self.registry)
        self.adapter_load_seconds = Histogram(
            "switchyard_adapter_load_seconds", "How long loading a LoRA adapter on an engine took "
            "(POST /v1/load_lora_adapter), by pool.", ["pool"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.stream_resumes = Counter(
            "switchyard_stream_resumes", "Broken streams by what became of them: resumed (continued on another "
            "endpoint), closed (the answer was complete: the gateway ended it), refused (not safe to continue, or "
            "resume_streams off), failed (no endpoint could continue it).", ["model", "outcome"],
            registry=self.registry)
        self.hedges = Counter(
            "switchyard_hedges", "Late first tokens of hedging classes, by pool of the first try and outcome: won "
            "(the hedge answered first), lost (the first try did), failed (both failed), not_sent (saturated fleet, "
            "retry budget or no other endpoint).", ["pool", "outcome"], registry=self.registry)
        self.hangs = Counter(
            "switchyard_endpoint_hangs", "Times an engine was found hung (accepting work, making no progress) and "
            "taken out, by pool and endpoint.", ["pool", "endpoint"], registry=self.registry)
        self.retries_refused = Counter(
            "switchyard_retry_budget_exhausted", "Retries not sent because the gateway's retry budget was spent "
            "(the request failed with its last error instead).", registry=self.registry)
        # The response cache.
        self.cache_lookups = Counter(
            "switchyard_cache_lookups", "Response-cache lookups, by rule, mode (exact, semantic) and result (hit, "
            "miss, error: the cache or the embedding pool failed, counted as a miss).", ["rule", "mode", "result"],
            registry=self.registry)
        self.cache_stores = Counter(
            "switchyard_cache_stores", "Answers offered to the response cache, by rule, mode and result (stored; "
            "too_large; incomplete: an error, a cancelled or broken stream, no usage; error: the cache failed).",
            ["rule", "mode", "result"], registry=self.registry)
        self.cache_entries = Gauge(
            "switchyard_cache_entries", "Entries in the response cache (this process's view of the backend).",
            registry=self.registry)
        self.cache_bytes = Gauge(
            "switchyard_cache_bytes", "Bytes of the response cache's entries.", registry=self.registry)
        self.cache_evictions = Gauge(
            "switchyard_cache_evictions", "Entries the response cache evicted since start-up, by reason (ttl, size).",
            ["reason"], registry=self.registry)
        # The request log's writer, read at each scrape (set up by the runtime when the log is on).
        self.request_log_pending = Gauge(
            "switchyard_request_log_pending", "Finished requests this process holds for the request log's next "
            "write.", registry=self.registry)
        self.request_log_dropped = Gauge(
            "switchyard_request_log_dropped", "Finished requests this process dropped from the request log since "
            "start-up (its buffer was full: the database was away, or the writer fell behind).",
            registry=self.registry)
        self.dependency_failures = Counter(
            "switchyard_dependency_failures", "Requests served or refused while a dependency of the gateway was "
            "unreachable, by dependency (redis, database) and what was done (fail_open, fail_closed).",
            ["dependency", "mode"], registry=self.registry)
        # The engines' KV-cache events, copied from the streams' state every second.
        self.kv_connected = Gauge(
            "switchyard_kv_events_connected", "1 while this process is connected to the endpoint's KV-cache events.",
            ["endpoint"], registry=self.registry)
        self.kv_stale = Gauge(
            "switchyard_kv_events_stale", "1 while the endpoint's events are not routed on (syncing, stale or cut: "
            "the approximate index routes instead).", ["endpoint"], registry=self.registry)
        self.kv_blocks = Gauge(
            "switchyard_kv_events_blocks", "Blocks the endpoint's prefix cache holds, as its events report.",
            ["endpoint"], registry=self.registry)
        self.kv_last_seq = Gauge(
            "switchyard_kv_events_last_sequence", "The sequence number of the endpoint's last batch applied.",
            ["endpoint"], registry=self.registry)
        self.kv_events = Counter(
            "switchyard_kv_events", "KV-cache events applied, by endpoint.", ["endpoint"], registry=self.registry)
        self.kv_gaps_recovered = Counter(
            "switchyard_kv_events_gaps_recovered", "Sequence gaps filled from the endpoint's replay socket.",
            ["endpoint"], registry=self.registry)
        self.kv_restarts = Counter(
            "switchyard_kv_events_restarts", "Times the endpoint's sequence went back (its engine restarted) and "
            "its index was read again.", ["endpoint"], registry=self.registry)
        self.kv_seconds = Counter(
            "switchyard_kv_events_processing_seconds", "Seconds this process spent decoding and applying KV-cache "
            "events (its event loop's CPU for them).", registry=self.registry)

        # The children the request path counts with (see Children).
        self.requests_by = Children(self.requests)
        self.duration_by = Children(self.duration)
        self.first_byte_by = Children(self.first_byte)
        self.in_flight_by = Children(self.in_flight)
        self.attempts_by = Children(self.attempts)
        self.cache_lookups_by = Children(self.cache_lookups)

    def usage_counters(self, model: str) -> tuple[Counter, Counter, Counter, Counter]:
        """The prompt, completion, cached-token and spend counters of ``model`` (looked up once per model)."""
        found = self._usage_children.get(model)
        if found is None:
            found = self._usage_children[model] = (
                self.tokens.labels(model, "prompt"), self.tokens.labels(model, "completion"),
                self.tokens.labels(model, "cached"), self.spend.labels(model))
        return found

    def set_policy(self, label: str, sha256: str, number: int | None) -> None:
        """Show the policy ``label`` (version ``number``) as the active one."""
        self.policy_info.clear()
        self.policy_info.labels(version=label, sha256=sha256[:12]).set(1)
        self.policy_version.set(number or 0)
