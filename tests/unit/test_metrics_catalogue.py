"""The gateway's metrics follow Prometheus' conventions, keep label cardinality bounded, and the README's
catalogue is what ``switchyard metrics`` prints.

Naming rules (https://prometheus.io/docs/practices/naming/), checked on every metric the registry holds:

- a name is snake_case (``[a-z0-9_]``, no ``__``, no trailing ``_``) and starts with ``switchyard_``;
- a counter's family name (as declared) does not end in ``_total``; scraped it does (prometheus_client
  appends it), and that ``_total`` sample is what a scrape shows;
- a gauge or histogram name never ends in ``_total``, nor in a suffix the exposition reserves for its own
  series (``_count``, ``_sum``, ``_bucket``, ``_created``); ``_info`` is for gauges only;
- units are base units: no name component is a scaled or non-base unit (``ms``, ``minutes``, ``kb``,
  ``percent``, ...); time is ``seconds``, size ``bytes``;
- a histogram observes a quantity with a unit, so its name ends in one: ``_seconds``, ``_bytes``, ``_tokens``
  (a count of tokens) or ``_ratio``; a histogram whose help text speaks of time ends in ``_seconds``.

Labels: snake_case, none reserved (``le``, ``quantile``, ``__*``), none that would carry an unbounded,
per-caller value (tenant, key, user, request, session, client address), each described in the
catalogue's label table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import Counter, Gauge, Histogram

from switchyard.cli import main
from switchyard.gateway import metrics_catalogue
from switchyard.gateway.metrics_catalogue import CatalogueError, MetricInfo, build_catalogue

ROOT = Path(__file__).resolve().parents[2]
README_BEGIN = "<!-- metrics-catalogue:begin (generated: switchyard metrics) -->"
README_END = "<!-- metrics-catalogue:end -->"

_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
#: Components that name a unit other than a base unit (or a scaled one).
_NON_BASE_UNITS = {"ms", "msec", "millis", "milliseconds", "us", "usec", "microseconds", "ns", "nanoseconds",
                   "sec", "secs", "minute", "minutes", "mins", "hour", "hours", "day", "days",
                   "kb", "mb", "gb", "kib", "mib", "gib", "kilobytes", "megabytes", "gigabytes", "bits",
                   "percent", "percentage", "pct", "celsius"}
_RESERVED_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")
_HISTOGRAM_UNITS = ("_seconds", "_bytes", "_tokens", "_ratio")
_TIME_WORDS = re.compile(r"\b(time|how long|took|latency|duration|wait(ed)?)\b", re.I)
#: Label names whose values grow with the callers, not with the policy.
_UNBOUNDED_LABELS = {"tenant", "tenant_id", "tenant_name", "key", "key_id", "api_key", "user", "user_id",
                     "username", "request_id", "session", "session_id", "client", "client_ip", "ip", "remote_addr"}


def naming_problems(m: MetricInfo) -> list[str]:
    """Every naming rule of the module docstring that ``m`` breaks."""
    problems: list[str] = []
    if not m.name.startswith("switchyard_"):
        problems.append("does not start with switchyard_")
    if not _SNAKE.match(m.family) or not _SNAKE.match(m.name):
        problems.append("is not snake_case")
    bad_units = set(m.name.split("_")) & _NON_BASE_UNITS
    if bad_units:
        problems.append(f"names a non-base unit {sorted(bad_units)}")
    if m.type == "counter":
        if m.family.endswith("_total"):
            problems.append("is a counter whose declared name already ends in _total")
        if m.name != f"{m.family}_total" or m.name not in m.series:
            problems.append("is a counter not scraped as <name>_total")
    else:
        if m.name.endswith(_RESERVED_SUFFIXES):
            problems.append(f"is a {m.type} ending in a reserved suffix {_RESERVED_SUFFIXES}")
    if m.name.endswith("_info") and m.type != "gauge":
        problems.append("ends in _info but is no gauge")
    if m.type == "histogram":
        if not m.name.endswith(_HISTOGRAM_UNITS):
            problems.append(f"is a histogram without a unit suffix {_HISTOGRAM_UNITS}")
        if _TIME_WORDS.search(m.help) and not m.name.endswith("_seconds"):
            problems.append("is a histogram of time not in _seconds")
        if set(m.series) != {f"{m.name}{s}" for s in ("_bucket", "_sum", "_count")}:
            problems.append(f"is a histogram scraped as {m.series}")
    if m.type == "gauge" and m.series != (m.name,):
        problems.append(f"is a gauge scraped as {m.series}")
    return problems


def label_problems(m: MetricInfo) -> list[str]:
    problems: list[str] = []
    for label in m.labels:
        if not _SNAKE.match(label.name) or label.name in {"le", "quantile"}:
            problems.append(f"label {label.name!r} is reserved or not snake_case")
        if label.name.lower() in _UNBOUNDED_LABELS:
            problems.append(f"label {label.name!r} has unbounded values")
    return problems


def _info(name: str, kind: str, labels: tuple[str, ...] = (), help_text: str = "Things.",
          series: tuple[str, ...] | None = None) -> MetricInfo:
    family = name.removesuffix("_total") if kind == "counter" else name
    if series is None:
        series = ((name,) if kind != "histogram" else tuple(f"{name}{s}" for s in ("_bucket", "_sum", "_count")))
    return MetricInfo(name, family, kind, help_text,
                      tuple(metrics_catalogue.LabelInfo(n, "bounded") for n in labels), series, ())


@pytest.fixture(scope="module")
def catalogue() -> list[MetricInfo]:
    return build_catalogue()


def test_catalogue_lists_every_registered_metric(catalogue: list[MetricInfo]) -> None:
    from switchyard.gateway.metrics import GatewayMetrics

    registered = {family.name for family in GatewayMetrics().registry.collect()}
    assert {m.family for m in catalogue} == registered
    assert len(catalogue) == len(registered)
    assert {m.type for m in catalogue} <= {"counter", "gauge", "histogram"}


def test_names_follow_prometheus_conventions(catalogue: list[MetricInfo]) -> None:
    broken = {m.name: naming_problems(m) for m in catalogue if naming_problems(m)}
    assert broken == {}


@pytest.mark.parametrize(("bad", "why"), [
    (_info("switchyard_requests", "counter", series=("switchyard_requests",)), "_total"),
    (_info("gateway_requests_total", "counter"), "switchyard_"),
    (_info("switchyard_Requests_total", "counter"), "snake_case"),
    (_info("switchyard_in_flight_total", "gauge"), "reserved suffix"),
    (_info("switchyard_latency", "histogram", help_text="How long it took."), "unit suffix"),
    (_info("switchyard_latency_tokens", "histogram", help_text="Time to first token."), "_seconds"),
    (_info("switchyard_latency_ms", "histogram"), "non-base unit"),
    (_info("switchyard_wait_minutes_total", "counter"), "non-base unit"),
    (_info("switchyard_version_info", "counter"), "_info"),
])
def test_naming_rules_catch_bad_names(bad: MetricInfo, why: str) -> None:
    assert any(why in problem for problem in naming_problems(bad)), naming_problems(bad)


def test_a_counter_declared_with_total_is_caught() -> None:
    """prometheus_client strips a declared ``_total``; the catalogue keeps the declared family name."""
    m = _info("switchyard_x_total", "counter")
    m = MetricInfo(m.name, "switchyard_x_total", m.type, m.help, m.labels, m.series, m.buckets)
    assert any("already ends in _total" in p for p in naming_problems(m))


def test_no_label_has_unbounded_values(catalogue: list[MetricInfo]) -> None:
    broken = {m.name: label_problems(m) for m in catalogue if label_problems(m)}
    assert broken == {}
    assert label_problems(_info("switchyard_x_total", "counter", ("model", "tenant_id")))
    assert label_problems(_info("switchyard_x_total", "counter", ("le",)))


def test_every_label_is_described(catalogue: list[MetricInfo]) -> None:
    for m in catalogue:
        for label in m.labels:
            assert label.values.strip(), f"{m.name}{{{label.name}}}"
            assert label.values == metrics_catalogue.METRIC_LABEL_VALUES.get(
                (m.name, label.name), metrics_catalogue.LABEL_VALUES.get(label.name))


def test_a_label_without_description_fails_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    values = dict(metrics_catalogue.LABEL_VALUES)
    del values["lane"]
    monkeypatch.setattr(metrics_catalogue, "LABEL_VALUES", values)
    with pytest.raises(CatalogueError, match="'lane'"):
        build_catalogue()
    result = CliRunner().invoke(main, ["metrics"])
    assert result.exit_code != 0
    assert "label 'lane' of switchyard_queue_depth has no description" in result.output


def test_a_stale_description_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_catalogue, "LABEL_VALUES", {**metrics_catalogue.LABEL_VALUES, "gone": "Nothing."})
    monkeypatch.setattr(metrics_catalogue, "METRIC_LABEL_VALUES",
                        {**metrics_catalogue.METRIC_LABEL_VALUES, ("switchyard_requests_total", "reason"): "No."})
    with pytest.raises(CatalogueError) as caught:
        build_catalogue()
    assert len(caught.value.issues) == 2


def test_a_metric_registered_outside_the_attributes_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from switchyard.gateway import metrics as gateway_metrics

    original = gateway_metrics.GatewayMetrics.__init__

    def init(self: gateway_metrics.GatewayMetrics) -> None:
        original(self)
        Gauge("switchyard_hidden", "Kept in no attribute.", registry=self.registry)

    monkeypatch.setattr(gateway_metrics.GatewayMetrics, "__init__", init)
    with pytest.raises(CatalogueError, match="switchyard_hidden is registered"):
        build_catalogue()


def test_a_new_metric_shows_in_the_catalogue(monkeypatch: pytest.MonkeyPatch) -> None:
    from switchyard.gateway import metrics as gateway_metrics

    original = gateway_metrics.GatewayMetrics.__init__

    def init(self: gateway_metrics.GatewayMetrics) -> None:
        original(self)
        self.extra_c = Counter("switchyard_extra", "Extra.", ["pool"], registry=self.registry)
        self.extra_h = Histogram("switchyard_extra_seconds", "Extra time.", ["pool"], registry=self.registry)

    monkeypatch.setattr(gateway_metrics.GatewayMetrics, "__init__", init)
    names = {m.name: m for m in build_catalogue()}
    assert names["switchyard_extra_total"].type == "counter"
    assert names["switchyard_extra_seconds"].buckets[0] == 0.005
    assert not naming_problems(names["switchyard_extra_total"])
    assert "`switchyard_extra_total`" not in _readme_catalogue()


def _readme_catalogue() -> str:
    readme = (ROOT / "README.md").read_text()
    assert readme.count(README_BEGIN) == 1
    assert readme.count(README_END) == 1
    return readme.split(README_BEGIN, 1)[1].split(README_END, 1)[0].strip("\n") + "\n"


def test_readme_catalogue_is_current() -> None:
    result = CliRunner().invoke(main, ["metrics"])
    assert result.exit_code == 0, result.output
    assert _readme_catalogue() == result.output, "run `switchyard metrics` and paste its output into the README"
    readme = (ROOT / "README.md").read_text()
    assert readme.index("### Metrics catalogue") < readme.index(README_BEGIN)


def test_json_lists_the_same_metrics(catalogue: list[MetricInfo]) -> None:
    result = CliRunner().invoke(main, ["metrics", "--format", "json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.output)["metrics"]
    assert [m["name"] for m in listed] == [m.name for m in catalogue]
    markdown = CliRunner().invoke(main, ["metrics"]).output
    in_table = re.findall(r"^\| `(switchyard_\w+)` \|", markdown, flags=re.M)
    assert in_table == [m["name"] for m in listed]
    for m in listed:
        assert set(m) == {"name", "family", "type", "help", "labels", "series", "buckets"}
        assert all(label["values"] for label in m["labels"])
        assert bool(m["buckets"]) == (m["type"] == "histogram")
