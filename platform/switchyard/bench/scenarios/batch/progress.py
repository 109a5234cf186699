"""What the ``batch`` scenario reads while an arm runs: the gateway's completion tokens by model and its queue
waits (``/metrics``), the batch's line counts (``GET /v1/batches/{id}``), every ``POLL_S`` on the run's clock;
and the JSON calls of the Batch API."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from switchyard.bench.sampler import by_label, samples
from switchyard.bench.scenarios.batch.workload import BATCH_MODEL, MODEL

#: How often the gateway's counters and the batch's progress are read.
POLL_S = 0.5
TOKENS = "switchyard_tokens_total"


def completion_tokens(metrics_text: str) -> dict[str, float]:
    """Completion tokens the gateway counted, by model (``switchyard_tokens_total{kind="completion"}``)."""
    out: dict[str, float] = {}
    for labels, value in samples(metrics_text, TOKENS):
        if labels.get("kind") == "completion" and "model" in labels:
            out[labels["model"]] = out.get(labels["model"], 0.0) + value
    return out


def queue_waits(metrics_text: str) -> dict[str, tuple[int, float]]:
    """Per class: requests that waited in the gateway's queue before dispatch, and their total wait (s)."""
    counts = by_label(metrics_text, "switchyard_queue_wait_seconds_count", "class")
    sums = by_label(metrics_text, "switchyard_queue_wait_seconds_sum", "class")
    return {cls: (int(n), sums.get(cls, 0.0)) for cls, n in counts.items()}


def interpolate(points: Sequence[tuple[float, float]], t: float) -> float | None:
    """A cumulative count sampled at ``points`` ((time, value), time ascending) at time ``t``.

    Linear between the samples around ``t``; None if ``t`` is outside them.
    """
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if t0 <= t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    if points and points[-1][0] == t:
        return points[-1][1]
    return None


@dataclass(slots=True)
class Sample:
    """One reading: the time on the run's clock, completion tokens by model, the batch's counts."""

    t_s: float
    tokens: dict[str, float]
    completed: int | None = None
    failed: int | None = None


@dataclass
class Progress:
    """Readings of the gateway's counters (and the batch's progress) while an arm runs."""

    samples: list[Sample] = field(default_factory=list)

    def series(self, model: str) -> list[tuple[float, float]]:
        return [(s.t_s, s.tokens.get(model, 0.0)) for s in self.samples]

    def lines(self, key: str) -> list[tuple[float, float]]:
        return [(s.t_s, float(getattr(s, key))) for s in self.samples if getattr(s, key) is not None]

    def over(self, points: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
        """How much a cumulative count grew over ``[start, end]`` (None: not read at both ends)."""
        a, b = interpolate(points, start), interpolate(points, end)
        return None if a is None or b is None else b - a

    def as_dict(self) -> dict[str, Any]:
        return {"t_s": [s.t_s for s in self.samples],
                "interactive_completion_tokens": [s.tokens.get(MODEL, 0.0) for s in self.samples],
                "batch_completion_tokens": [s.tokens.get(BATCH_MODEL, 0.0) for s in self.samples],
                "batch_completed": [s.completed for s in self.samples],
                "batch_failed": [s.failed for s in self.samples]}


async def _answer(response: aiohttp.ClientResponse, what: str) -> dict[str, Any]:
    """The JSON object of a 200 answer to ``what`` (``GET <url>``); anything else raises."""
    body = await response.read()
    if response.status != 200:
        raise RuntimeError(f"{what} answered {response.status}: {body[:300].decode('utf-8', 'replace')}")
    data: dict[str, Any] = json.loads(body)
    return data


async def get_json(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> dict[str, Any]:
    """``GET url``'s JSON object (anything but a 200 raises ``RuntimeError``)."""
    async with session.get(url, headers=headers) as response:
        return await _answer(response, f"GET {url}")


async def post_json(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str],
                     payload: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``POST url``'s JSON object (anything but a 200 raises ``RuntimeError``)."""
    async with session.post(url, headers=headers, json=payload) as response:
        return await _answer(response, f"POST {url}")


async def submit_batch(session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str], content: bytes,
                       bench: str) -> str:
    """Upload ``content`` (JSONL of chat lines) and make a batch of it (``metadata.bench``: ``bench``); its id.
    A batch refused at once (``failed``) raises ``RuntimeError``."""
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename=f"{bench}.jsonl", content_type="application/jsonl")
    async with session.post(f"{base_url}/v1/files", headers=headers, data=form) as response:
        uploaded = await _answer(response, f"POST {base_url}/v1/files")
    batch = await post_json(session, f"{base_url}/v1/batches", headers,
                            {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                             "completion_window": "24h", "metadata": {"bench": bench}})
    if batch["status"] == "failed":
        raise RuntimeError(f"the batch was refused: {batch.get('errors')}")
    return str(batch["id"])


async def read_sample(session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str],
                      batch_id: str | None, start: float) -> Sample | None:
    """One reading, timed on the run's clock (``start``: its zero); None if the gateway did not answer."""
    at = asyncio.get_running_loop().time()
    try:
        async with session.get(f"{base_url}/metrics") as response:
            metrics = await response.text()
        # The reading's time: when it was asked for (the answers come within milliseconds).
        sample = Sample(at - start, completion_tokens(metrics))
        if batch_id is not None:
            counts = (await get_json(session, f"{base_url}/v1/batches/{batch_id}", headers))["request_counts"]
            sample.completed, sample.failed = int(counts["completed"]), int(counts["failed"])
    except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError, ValueError):
        return None  # a missed reading: the interpolation spans the gap
    return sample


async def poll(session: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str], batch_id: str | None,
               start: float, progress: Progress) -> None:
    """Read the counters every ``POLL_S`` (on the run's clock, from ``start``) until cancelled."""
    loop = asyncio.get_running_loop()
    index = 1  # the reading at the start was taken before it
    while True:
        await asyncio.sleep(max(0.0, start + index * POLL_S - loop.time()))
        sample = await read_sample(session, base_url, headers, batch_id, start)
        if sample is not None:
            progress.samples.append(sample)
        index = max(index + 1, math.floor((loop.time() - start) / POLL_S) + 1)
