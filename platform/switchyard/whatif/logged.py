"""A workload from the request log: what clients actually sent, as a replay can send it again.

The request log (``store.request_log``) keeps, per request, when it arrived, its tier, the model
it asked for, its kind, whether it streamed, the prompt tokens (counted at admission, or the
engine's usage), the tokens generated, the tokens the engine served from its prefix cache and the
output budget asked for — never the text. :func:`log_workload` turns entries into
:class:`~switchyard.bench.spec.RequestSpec` s:

- **Arrivals** keep their spacing (divided by ``rate_multiplier``), from the first entry.
- **Who**: the entry's tier is the replay's tenant (a replay runs each tier as one tenant).
- **Prompt**: synthetic text of the logged length, less the simulated engine's template tokens.
  The text is never logged, so prefix sharing is rebuilt from the prefix-cache hits: an entry
  whose prompt was partly served from the engine's prefix cache starts with a shared segment of that
  many tokens, the same segment for every entry of its tier and model (a system prompt, most
  often). Prompts otherwise share nothing.
- **Output**: the tokens the request generated when it ran (sent with ``ignore_eos``, as the
  trace replays do); a request that never ran generates its ``max_tokens``, or, when it asked
  for none, the median of what the requests that ran generated (``fill_output``).
- **Repeats**: entries with the same fingerprint (``digest``: the request as the response cache
  keys it) are the same request: they get one prompt and one output length (the first
  occurrence's), and ``temperature: 0`` when the client asked for a reproducible answer, so that
  the replay's response cache sees them repeat as the gateway's did. Entries logged before the
  fingerprint was kept never repeat.

- **Identity**: the tenant's and key's ids and the request id, which a replayed canary's slice is
  hashed by as the gateway hashed it (:func:`log_who`); the replay's tenant stays the tier.

Entries that cannot be replayed are counted, not guessed: those with no tier (the key was
refused) or no prompt count (refused before the body was read).

The log keeps successes at its sample rate and every failure, so with a sample rate under 1 the
replay's mix leans to the failures; ``describe()`` carries the counts so the report can say so.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, cast

from sqlmodel import Session, col, select

from switchyard.bench.prompts import SynthText, prompt_overhead_tokens, unique_key
from switchyard.bench.spec import Labels, RequestSpec, Workload, WorkloadError
from switchyard.store.models import RequestLogEntry
from switchyard.whatif.canary import Who

#: Output tokens of a request that never ran and set no budget, when no request of the log ran either.
DEFAULT_OUTPUT = 256
#: Entries read at most for one replay.
MAX_ENTRIES = 50_000


@dataclass(slots=True)
class LogEntry:
    """One request as the log has it: the fields of a ``RequestLogEntry`` a replay reads (plain data, so it
    can travel to a worker process)."""

    at: datetime
    kind: str
    tier: str | None
    model: str | None
    stream: bool
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    max_tokens: int | None = None
    digest: str | None = None
    deterministic: bool | None = None
    cache: str = "none"
    tenant_id: int | None = None
    key_id: int | None = None
    request_id: str | None = None


def read_log(session: Session, *, since: datetime | None = None, window: timedelta | None = None,
             limit: int = MAX_ENTRIES) -> list[LogEntry]:
    """The newest ``limit`` entries at or after ``since`` (or within ``window`` of now), oldest first."""
    if since is None and window is not None:
        since = datetime.now(UTC) - window
    query = select(RequestLogEntry)
    if since is not None:
        query = query.where(col(RequestLogEntry.at) >= since)
    query = query.order_by(col(RequestLogEntry.at).desc(), col(RequestLogEntry.id).desc()).limit(limit)
    return [LogEntry(at=r.at, kind=r.kind, tier=r.tier, model=r.model, stream=r.stream, status=r.status,
                     prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens,
                     cached_tokens=r.cached_tokens, max_tokens=r.max_tokens, digest=r.digest,
                     deterministic=r.deterministic, cache=r.cache, tenant_id=r.tenant_id, key_id=r.key_id,
                     request_id=r.request_id) for r in reversed(list(session.exec(query)))]


def fill_output(entries: Sequence[LogEntry]) -> int:
    """What a request that never ran and asked for no budget generates: the median of those that ran."""
    ran = [e.completion_tokens for e in entries if e.completion_tokens]
    return int(statistics.median(ran)) if ran else DEFAULT_OUTPUT


def _kind(value: str) -> Literal["chat", "completion"]:
    """The kind an entry is replayed as (a Responses API request is a chat rendered from its input)."""
    return "completion" if value == "completion" else "chat"


#: The kinds of logged requests the replay can simulate (the engines it simulates generate).
REPLAYED_KINDS = frozenset({"chat", "completion", "responses"})


def _recipe(entry: LogEntry, index: int, kind: Literal["chat", "completion"], model: str, seed: int,
            fill: int) -> tuple[SynthText, int, str | None]:
    """An entry's prompt, output length and prefix group (see the module doc)."""
    assert entry.prompt_tokens is not None
    text_tokens = max(1, entry.prompt_tokens - prompt_overhead_tokens(kind))
    # A response-cache hit's cached tokens are its whole prompt, not a prefix the engine kept.
    cached = 0 if entry.cache == "hit" else (entry.cached_tokens or 0)
    shared = min(max(0, cached - prompt_overhead_tokens(kind)), text_tokens)
    segments: list[tuple[int, int]] = []
    if shared:
        segments.append((unique_key("log-prefix", entry.tier, model), shared))
    if text_tokens - shared:
        segments.append((unique_key("log", seed, entry.digest or index), text_tokens - shared))
    ran = entry.completion_tokens is not None and entry.status == 200
    output = max(1, entry.completion_tokens if ran and entry.completion_tokens else (entry.max_tokens or fill))
    group = f"log:{entry.tier}:{model}" if shared else None
    return SynthText(tuple(segments), seed), output, group


def _usable(ordered: Sequence[LogEntry], default_model: str | None) -> tuple[list[LogEntry], dict[str, int]]:
    """The entries that can be replayed (in the given order), and how many could not, by reason."""
    usable: list[LogEntry] = []
    skipped: dict[str, int] = {"no_tier": 0, "no_prompt_count": 0, "no_model": 0, "not_generation": 0}
    for entry in ordered:
        if entry.kind not in REPLAYED_KINDS:
            skipped["not_generation"] += 1
        elif not entry.tier:
            skipped["no_tier"] += 1
        elif not entry.prompt_tokens:
            skipped["no_prompt_count"] += 1
        elif not entry.model and default_model is None:
            skipped["no_model"] += 1
        else:
            usable.append(entry)
    return usable, skipped


def log_who(entries: Sequence[LogEntry], *, default_model: str | None = None) -> dict[int, Who]:
    """Who sent each request of :func:`log_workload`'s workload of the same entries, by the request's index: the
    tenant's and key's ids and the request id, as the gateway hashed a canary's slice by them (an entry without
    them is left to the replay's own)."""
    usable, _ = _usable(sorted(entries, key=lambda e: e.at), default_model)
    return {i: Who(None if e.tenant_id is None else str(e.tenant_id), None if e.key_id is None else str(e.key_id),
                   e.request_id)
            for i, e in enumerate(usable) if e.tenant_id is not None or e.key_id is not None or e.request_id}


def log_workload(entries: Sequence[LogEntry], *, rate_multiplier: float = 1.0, seed: int = 0,
                 default_model: str | None = None) -> Workload:
    """The entries (any order) as a workload in arrival order (see the module doc).

    ``default_model``: what an entry that named no model asks for (None: such entries are skipped).

    Raises:
        WorkloadError: ``rate_multiplier`` is not positive.
    """
    if rate_multiplier <= 0:
        raise WorkloadError(f"rate_multiplier must be > 0, got {rate_multiplier}")
    ordered = sorted(entries, key=lambda e: e.at)
    usable, skipped = _usable(ordered, default_model)
    fill = fill_output(usable)
    specs: list[RequestSpec] = []
    t0 = usable[0].at if usable else None
    recipes: dict[str, tuple[SynthText, int, str | None]] = {}
    repeats = 0
    for i, entry in enumerate(usable):
        assert t0 is not None
        assert entry.tier is not None
        kind = _kind(entry.kind)
        model = entry.model or cast(str, default_model)
        recipe = recipes.get(entry.digest) if entry.digest else None
        if recipe is None:
            recipe = _recipe(entry, i, kind, model, seed, fill)
            if entry.digest:
                recipes[entry.digest] = recipe
        else:
            repeats += 1
        prompt, output, group = recipe
        extra: dict[str, Any] = {"ignore_eos": True}
        if entry.deterministic:
            extra["temperature"] = 0
        labels = Labels(tenant=entry.tier, request_class=entry.tier, model=model, kind=kind, stream=entry.stream,
                        extra_body=extra)
        arrival = (entry.at - t0).total_seconds() / rate_multiplier
        specs.append(RequestSpec(i, arrival, prompt, output, labels, group))
    duration = specs[-1].arrival_s if specs else 0.0
    source: dict[str, Any] = {
        "source": "request log", "entries": len(ordered), "skipped": skipped, "rate_multiplier": rate_multiplier,
        "seed": seed, "first": ordered[0].at.isoformat() if ordered else None,
        "last": ordered[-1].at.isoformat() if ordered else None,
        "refused_in_log": sum(1 for e in usable if e.status != 200), "filled_output_tokens": fill,
        "repeats": repeats,
    }
    return Workload(tuple(specs), duration, source)
