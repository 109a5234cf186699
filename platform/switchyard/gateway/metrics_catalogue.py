"""The catalogue of the gateway's Prometheus metrics, read off a live ``GatewayMetrics``.

``switchyard metrics`` prints it (Markdown or JSON) and the README carries the Markdown; nothing here
repeats a name, type, label or help text, so the catalogue cannot drift from the code. What the code
cannot say is which values a label takes: ``LABEL_VALUES`` describes each label's bounded value set
(``METRIC_LABEL_VALUES`` where one label name means different things on different metrics), and
``build_catalogue`` refuses a label without a description, or a description without a label.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from prometheus_client.metrics import MetricWrapperBase

from switchyard.gateway.metrics import GatewayMetrics

#: What each label's values are. Every value set must be bounded by the code or the policy (no
#: tenant id, key, user or request id), so that a scrape's size does not grow with traffic.
LABEL_VALUES: dict[str, str] = {
    "class": "A priority class name of the policy's `priorities` (`-` on `switchyard_requests_total` when the "
             "request was refused before its class was known).",
    "classifier": "An embedding classifier name of the policy's `classifiers`.",
    "dependency": "`redis` (the limit store) or `database` (key lookups).",
    "endpoint": "An endpoint URL of the policy's pools.",
    "field": "What a shadow decision can differ in: `model`, `class`, `pool`, `region`, `admission` or `cache`.",
    "generation": "The garbage collector's generation: `0`, `1` or `2` (a full collection).",
    "kind": "`prompt`, `completion` or `cached` (prompt tokens found in the engine's prefix cache).",
    "lane": "`interactive` or `batch` (the class's lane).",
    "limit": "`tokens_per_minute`, `requests_per_minute`, `tokens_per_day` or `spend_per_month`.",
    "region": "A region of the policy's `regions` (`-` when no engine served the request).",
    "tier": "A tier name of the policy's `tiers` (`-` when the request was refused before its key was known).",
    "model": "A model name of the policy's `models` (`-` on `switchyard_requests_total` when the request was "
             "refused before its model was resolved).",
    "name": "The endpoint URL (scope `endpoint`) or the pool name (scope `pool`) of the policy.",
    "pool": "A pool name of the policy's `pools` (on `switchyard_requests_total` also `cache`, a response-cache "
            "hit, and `-`, refused or failed before an engine answered).",
    "role": "`canary`, `control` or `shadow`.",
    "rule": "A response-cache rule of the policy's `cache`: its name, or `cache[<index>]` when unnamed.",
    "scope": "`endpoint` or `pool`.",
    "sha256": "The first 12 hex digits of the active policy's SHA-256 (one series at a time).",
    "source": "`file` or `database`, where the rejected document came from.",
    "status": "The HTTP status code of the gateway's answer.",
    "to": "`closed`, `half_open` or `open`.",
    "version": "The active policy's version, e.g. `v12` (its short hash if unversioned; one series at a time).",
}

#: Descriptions of a label name that means different things on different metrics, by (metric as
#: scraped, label); they take precedence over ``LABEL_VALUES``.
METRIC_LABEL_VALUES: dict[tuple[str, str], str] = {
    ("switchyard_upstream_attempts_total", "outcome"):
        "`ok`, `connect_error`, `timeout`, `broken`, `first_token_timeout`, `hung`, `body_error`, `body_timeout`, "
        "`invalid_response`, `adapter_load` (the engine would not load a LoRA adapter), or the engine's HTTP status "
        "code.",
    ("switchyard_stream_resumes_total", "outcome"): "`resumed`, `closed`, `refused` or `failed`.",
    ("switchyard_adapter_loads_total", "outcome"): "`loaded`, `already` (the engine had it) or `failed`.",
    ("switchyard_hedges_total", "outcome"): "`won`, `lost`, `failed` or `not_sent`.",
    ("switchyard_classifier_total", "outcome"): "`yes`, `no`, `error` or `timeout`.",
    ("switchyard_requests_total", "outcome"):
        "`ok`, `refused` (a 4xx other than 429), `limited` (429), `shed` (flow control's 503), `error` (5xx, or a "
        "stream the engine broke off) or `client_closed` (499).",
    ("switchyard_shed_total", "reason"):
        "`utilisation`, `deadline`, `predicted_wait` or `lane_full` (a batch line the batch lane had no waiting room "
        "for: it goes back to its job's queue).",
    ("switchyard_downgrades_total", "reason"):
        "`shed_threshold`, `saturated` or `headroom` (`on_saturation.at_utilisation`).",
    ("switchyard_fallbacks_total", "reason"):
        "`connect_error`, `timeout`, `broken`, `first_token_timeout`, `hung`, `body_error`, `body_timeout`, "
        "`invalid_response`, the engine's HTTP status code, or `unavailable` (no endpoint of a stage in service).",
    ("switchyard_cache_evictions", "reason"): "`ttl` or `size`.",
    ("switchyard_cache_lookups_total", "mode"): "`exact` or `semantic`.",
    ("switchyard_cache_stores_total", "mode"): "`exact` or `semantic`.",
    ("switchyard_dependency_failures_total", "mode"): "`fail_open` or `fail_closed`.",
    ("switchyard_cache_lookups_total", "result"): "`hit`, `miss` or `error`.",
    ("switchyard_cache_stores_total", "result"): "`stored`, `too_large`, `incomplete` or `error`.",
}

# The timestamp series prometheus_client adds to counters and histograms (left out: whether it is
# exported is the process's setting, not the metric's).
_CREATED = "_created"


class CatalogueError(Exception):
    """The metrics and the label descriptions disagree; ``issues`` says where."""

    def __init__(self, issues: list[str]) -> None:
        super().__init__("; ".join(issues))
        self.issues = issues


@dataclass(frozen=True)
class LabelInfo:
    """One label of a metric and the values it takes."""

    name: str
    values: str


@dataclass(frozen=True)
class MetricInfo:
    """One metric family as ``/metrics`` exports it."""

    name: str  #: as scraped: counters with ``_total``, histograms by their base name
    family: str  #: the family's name in the exposition's ``# TYPE`` line (a counter's without ``_total``)
    type: str  #: ``counter``, ``gauge`` or ``histogram``
    help: str
    labels: tuple[LabelInfo, ...]
    series: tuple[str, ...]  #: the sample names a scrape shows
    buckets: tuple[float, ...]  #: a histogram's finite upper bounds (``+Inf`` is implied)


def _metric_objects(metrics: GatewayMetrics) -> list[MetricWrapperBase]:
    return [value for value in vars(metrics).values() if isinstance(value, MetricWrapperBase)]


def build_catalogue() -> list[MetricInfo]:
    """Every metric of a fresh ``GatewayMetrics``, sorted by name; ``CatalogueError`` when a label has no
    description, a description names no label, or the registry holds a metric that is no attribute."""
    metrics = GatewayMetrics()
    objects = _metric_objects(metrics)
    issues: list[str] = []
    families: dict[str, tuple[str, str, str, tuple[str, ...]]] = {}
    for obj in objects:
        (family,) = obj.describe()
        families[family.name] = (family.name, family.type, family.documentation, tuple(obj._labelnames))
        if obj._labelnames:  # one child, so that the scrape shows the family's series
            obj.labels(*["x"] * len(obj._labelnames))
    series: dict[str, list[str]] = {}
    buckets: dict[str, list[float]] = {}
    for family in metrics.registry.collect():
        if family.name not in families:
            issues.append(f"{family.name} is registered but is no attribute of GatewayMetrics")
            continue
        names = series.setdefault(family.name, [])
        for sample in family.samples:
            if not sample.name.endswith(_CREATED) and sample.name not in names:
                names.append(sample.name)
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                buckets.setdefault(family.name, []).append(float(sample.labels["le"]))

    used: set[str] = set()
    used_pairs: set[tuple[str, str]] = set()
    catalogue: list[MetricInfo] = []
    for family_name, kind, documentation, labelnames in families.values():
        name = f"{family_name}_total" if kind == "counter" else family_name
        labels: list[LabelInfo] = []
        for label in labelnames:
            values = METRIC_LABEL_VALUES.get((name, label))
            if values is not None:
                used_pairs.add((name, label))
            else:
                values = LABEL_VALUES.get(label)
                used.add(label)
            if not values:
                issues.append(f"label {label!r} of {name} has no description in LABEL_VALUES")
                continue
            labels.append(LabelInfo(label, values))
        catalogue.append(MetricInfo(name, family_name, kind, documentation, tuple(labels),
                                    tuple(series.get(family_name, ())), tuple(buckets.get(family_name, ()))))
    issues += [f"LABEL_VALUES describes {label!r}, which no metric has" for label in sorted(set(LABEL_VALUES) - used)]
    issues += [f"METRIC_LABEL_VALUES describes {label!r} of {name}, which it does not have"
               for name, label in sorted(set(METRIC_LABEL_VALUES) - used_pairs)]
    if issues:
        raise CatalogueError(issues)
    return sorted(catalogue, key=lambda m: m.name)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(catalogue: list[MetricInfo]) -> str:
    """Two tables: the metrics (name, type, labels, meaning), then each label's values."""
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in catalogue:
        labels = ", ".join(f"`{label.name}`" for label in m.labels) or "—"
        lines.append(f"| `{m.name}` | {m.type} | {labels} | {_cell(m.help)} |")
    lines += ["", "A histogram `X` is scraped as `X_bucket{le}`, `X_sum` and `X_count` (its buckets: "
              "`switchyard metrics --format json`). Label values:", "",
              "| label | on | values |", "|---|---|---|"]
    rows: dict[tuple[str, str], list[str]] = {}
    for m in catalogue:
        for label in m.labels:
            rows.setdefault((label.name, label.values), []).append(m.name)
    for (label_name, values), names in sorted(rows.items()):
        on = ", ".join(f"`{n}`" for n in names)
        lines.append(f"| `{label_name}` | {on} | {_cell(values)} |")
    return "\n".join(lines) + "\n"


def render_json(catalogue: list[MetricInfo]) -> str:
    """``{"metrics": [{name, family, type, help, labels: [{name, values}], series, buckets}]}``."""
    metrics = [{"name": m.name, "family": m.family, "type": m.type, "help": m.help,
                "labels": [{"name": label.name, "values": label.values} for label in m.labels],
                "series": list(m.series),
                "buckets": list(m.buckets)}
               for m in catalogue]
    return json.dumps({"metrics": metrics}, indent=2, ensure_ascii=False) + "\n"
