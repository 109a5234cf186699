"""Load signals from each engine's Prometheus ``/metrics``, read on an interval.

vLLM's exposition is large (tens of kB of histogram buckets per engine) and the gateway needs a few
series of it (load, and the counters that say whether the engine makes progress), so the parser reads
only sample lines of those names instead of building every metric family: it is called for every
endpoint every second on the event loop that serves requests. ``tests/unit/engines/test_scrape.py``
checks it against ``prometheus_client``'s parser.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator

import aiohttp

from switchyard.engines.endpoints import EndpointRegistry, EngineSignals

log = logging.getLogger("switchyard.scrape")

#: The series read, by what they mean. vLLM V1 names; ``gpu_cache_usage_perc`` is the V0 name of
#: KV-cache usage, still read for older servers.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
#: Counters that move whenever the engine's scheduler makes a step that produces something (tokens generated,
#: prompts whose prefill completed, engine iterations with output): a busy engine whose counters stand still is
#: hung (``EndpointState.record_progress``).
PROGRESS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:iteration_tokens_total_count")
_WANTED = (RUNNING, WAITING, *KV_USAGE, PREFIX_QUERIES, PREFIX_HITS, *PROGRESS)
#: The served model's name is read from the running series' ``model_name`` label.
_MODEL_LABEL = 'model_name="'
#: Waiting requests deferred for a LoRA adapter slot (vLLM's other reason is ``capacity``).
DEFERRED = "vllm:num_requests_waiting_by_reason"
_DEFERRED_LABEL = 'reason="deferred"'
#: LoRA adapters: one series per label set seen, set to the time it was last current: the latest is the largest.
LORA_INFO = "vllm:lora_requests_info"
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class MetricsFormatError(ValueError):
    """The text is not a vLLM metrics exposition (none of the load series is in it)."""


def _samples(text: str, name: str) -> Iterator[tuple[str | None, float]]:
    """The labels (None: none) and value of each sample line of series ``name`` in ``text`` (which starts with a
    newline), lines whose labels do not close or whose value is not a number left out; a value that is not finite
    counts 0.

    The series are found with ``str.find``: the text is read at C speed, and only the lines wanted are split.
    """
    key = "\n" + name
    at = text.find(key)
    while at >= 0:
        start = at + len(key)
        end = text.find("\n", start)
        if end < 0:
            end = len(text)
        line = text[start:end]
        at = text.find(key, end)
        head = line[:1]
        labels: str | None
        if head == "{":
            labels, brace, line = line[1:].rpartition("}")
            if not brace:
                continue  # the labels never close
        elif head in (" ", "\t"):
            labels = None
        else:
            continue  # a longer name that starts with this one
        fields = line.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        yield labels, value if math.isfinite(value) else 0.0


def _model_name(labels: str) -> str | None:
    start = labels.find(_MODEL_LABEL)
    if start < 0:
        return None
    start += len(_MODEL_LABEL)
    end = labels.find('"', start)
    return labels[start:end] if end > start else None


def parse_engine_metrics(text: str) -> EngineSignals:
    """The load signals in a ``/metrics`` text, summed over label sets (engines, models).

    Raises:
        MetricsFormatError: neither running nor waiting requests are reported.
    """
    text = "\n" + text
    sums: dict[str, float] = {}
    kv: list[float] = []
    models: set[str] = set()
    for name in _WANTED:
        for labels, value in _samples(text, name):
            if name in KV_USAGE:
                kv.append(value)
                continue
            sums[name] = sums.get(name, 0.0) + value
            if name == RUNNING and labels is not None and (model := _model_name(labels)) is not None:
                models.add(model)
    deferred = sum((value for labels, value in _samples(text, DEFERRED)
                    if labels is not None and _DEFERRED_LABEL in labels), 0.0)
    lora: tuple[float, str] | None = None
    for labels, value in _samples(text, LORA_INFO):
        if labels is not None and (lora is None or value > lora[0]):
            lora = (value, labels)
    if RUNNING not in sums and WAITING not in sums:
        raise MetricsFormatError(f"no {RUNNING} or {WAITING} series")
    counters = [sums[name] for name in PROGRESS if name in sums]
    adapters, max_loras = _lora_info(lora[1]) if lora is not None else (None, None)
    return EngineSignals(
        running=sums.get(RUNNING, 0.0),
        waiting=sums.get(WAITING, 0.0),
        # Several engines behind one URL (data parallel) each report a fraction; the most
        # loaded one bounds what can be admitted.
        kv_usage=max(kv) if kv else 0.0,
        prefix_queries=sums.get(PREFIX_QUERIES, 0.0),
        prefix_hits=sums.get(PREFIX_HITS, 0.0),
        models=frozenset(models),
        progress=sum(counters) if counters else None,
        adapters=adapters,
        max_loras=max_loras,
        deferred=min(deferred, sums.get(WAITING, 0.0)),
    )


def _lora_info(labels: str) -> tuple[frozenset[str], int | None]:
    """The adapters running or waiting (names) and ``max_lora`` of a ``vllm:lora_requests_info`` label set."""
    values: dict[str, str] = dict(_LABEL.findall(labels))
    names = {n for key in ("running_lora_adapters", "waiting_lora_adapters")
             for n in values.get(key, "").split(",") if n}
    try:
        most = int(values["max_lora"]) if "max_lora" in values else None
    except ValueError:
        most = None
    return frozenset(names), most


class MetricsScraper:
    """Reads every endpoint's ``/metrics`` each interval into an :class:`EndpointRegistry`.

    A refused connection is reported to ``refused`` (the gateway takes the endpoint out until its
    health probes succeed); any other failure only ages its signals out, so load falls back to the
    gateway's own accounting.
    """

    def __init__(self, registry: EndpointRegistry, session: aiohttp.ClientSession,
                 urls: Callable[[], Iterable[str]], interval_s: float,
                 refused: Callable[[str, str], None] | None = None) -> None:
        self.registry = registry
        self.session = session
        self.urls = urls
        self.interval_s = interval_s
        self.refused = refused
        self._timeout = aiohttp.ClientTimeout(total=max(0.5, min(interval_s * 2, 5.0)))

    async def scrape(self, url: str) -> None:
        """Read one endpoint's metrics and record what they say."""
        try:
            async with self.session.get(url + "/metrics", timeout=self._timeout, allow_redirects=False) as response:
                if response.status != 200:
                    self.registry.record_scrape_error(url, f"/metrics answered {response.status}")
                    return
                text = await response.text()
            signals = parse_engine_metrics(text)
        except aiohttp.ClientConnectorError as exc:
            reason = f"cannot connect: {exc.os_error.strerror or exc.os_error}"
            self.registry.record_scrape_error(url, reason)
            if self.refused is not None:
                self.refused(url, reason)
            return
        except (TimeoutError, aiohttp.ClientError, MetricsFormatError, UnicodeDecodeError) as exc:
            self.registry.record_scrape_error(url, f"{exc.__class__.__name__}: {exc}")
            return
        self.registry.record_scrape(url, signals, time.monotonic())

    async def run(self) -> None:
        """Scrape forever (cancel the task to stop)."""
        while True:
            started = time.monotonic()
            urls = sorted(set(self.urls()))
            if urls:
                await asyncio.gather(*(self.scrape(url) for url in urls))
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
