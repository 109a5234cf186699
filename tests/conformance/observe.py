"""What a client can observe of an engine, reduced to structure: shapes, events, metric families."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Shape = Any
#: Label values that are structure, not state: histogram buckets and enumerations.
ENUMERATED_LABELS = frozenset({"le", "finished_reason", "source", "sleep_state", "reason"})


def shape(value: object) -> Shape:
    """The structure of a JSON value: keys kept, scalars replaced by their type's name.

    A list becomes the list of its elements' distinct shapes (``[]`` when empty), so one choice
    or five give the same shape; objects with the same keys are merged first, so an empty list
    in one element and a list of ints in another read as a list of ints. Type names are JSON's
    as Python reads them: str, int, float, bool, null.
    """
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        shapes: list[Shape] = []
        for item in value:
            s = shape(item)
            for i, known in enumerate(shapes):
                merged = _merge(known, s)
                if merged is not None:
                    shapes[i] = merged
                    break
            else:
                shapes.append(s)
        return shapes
    return "null" if value is None else type(value).__name__


def _merge(a: Shape, b: Shape) -> Shape | None:
    """One shape covering both, if they differ only by empty lists; else None."""
    if a == b:
        return a
    if isinstance(a, list) and isinstance(b, list) and (not a or not b):
        return a or b
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        merged = {k: _merge(a[k], b[k]) for k in a}
        return None if any(v is None for v in merged.values()) else merged
    return None


def diff(a: Shape, b: Shape, path: str = "$") -> list[str]:
    """Where two shapes differ, one line per difference (empty when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in the first" for k in a if k not in b]
        out += [f"{path}.{k}: only in the second" for k in b if k not in a]
        for k in a:
            if k in b:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if a != b:
        return [f"{path}: {a!r} != {b!r}"]
    return []


def assert_shape(actual: Shape, expected: Shape, what: str) -> None:
    """Fail with every difference listed."""
    problems = diff(actual, expected)
    assert not problems, f"{what} differs from the expected shape:\n  " + "\n  ".join(problems)


@dataclass(frozen=True)
class Stream:
    """A server-sent event stream as a client reads it."""

    status: int
    content_type: str
    chunks: list[dict[str, Any]]
    done: bool

    @classmethod
    def parse(cls, status: int, content_type: str, text: str) -> Stream:
        """Split ``data:`` events; ``[DONE]`` must be the last one."""
        chunks: list[dict[str, Any]] = []
        done = False
        for event in text.split("\n\n"):
            if not event.strip():
                continue
            assert event.startswith("data: "), f"not an SSE data event: {event[:80]!r}"
            assert not done, "an event after [DONE]"
            data = event.removeprefix("data: ")
            if data == "[DONE]":
                done = True
            else:
                chunks.append(json.loads(data))
        return cls(status, content_type, chunks, done)

    @property
    def usage_chunk(self) -> dict[str, Any] | None:
        """The final ``include_usage`` chunk (no choices), if any."""
        last = self.chunks[-1] if self.chunks else None
        return last if last is not None and last["choices"] == [] else None

    def choice_chunks(self) -> list[dict[str, Any]]:
        """Chunks with a choice, in order."""
        return [c for c in self.chunks if c["choices"]]


def post_json(url: str, body: object) -> httpx.Response:
    """POST a JSON body with plain httpx."""
    return httpx.post(url, json=body, timeout=120)


def post_raw(url: str, raw: bytes) -> httpx.Response:
    """POST bytes as ``application/json`` (bodies the SDK will not send)."""
    return httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=120)


def stream(url: str, body: dict[str, Any]) -> Stream:
    """POST a streaming request with httpx and read the whole event stream."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
        text = resp.read().decode()
        return Stream.parse(resp.status_code, resp.headers.get("content-type", ""), text)


@dataclass(frozen=True)
class Family:
    """One metric family's structure: its type, and per sample suffix the label names and the
    values of enumerated labels."""

    type: str
    series: frozenset[tuple[str, frozenset[str]]]
    enumerations: frozenset[tuple[str, str]]

    @property
    def label_names(self) -> frozenset[str]:
        """Every label name of the family's samples (``le`` included for histograms)."""
        return frozenset(name for _, names in self.series for name in names)


def metric_families(text: str) -> dict[str, Family]:
    """Every family of a Prometheus text exposition, by name, reduced to its structure."""
    out: dict[str, Family] = {}
    for family in text_string_to_metric_families(text):
        series = set()
        enums = set()
        for sample in family.samples:
            suffix = sample.name[len(family.name):]
            series.add((suffix, frozenset(sample.labels)))
            enums.update((k, v) for k, v in sample.labels.items() if k in ENUMERATED_LABELS)
        out[family.name] = Family(family.type, frozenset(series), frozenset(enums))
    return out


def sample_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    assert found, f"no sample {name} {labels}"
    return total


def without(names: Iterable[str], prefixes: Iterable[str]) -> set[str]:
    """``names`` minus those starting with any of ``prefixes``."""
    prefixes = tuple(prefixes)
    return {n for n in names if not n.startswith(prefixes)}
