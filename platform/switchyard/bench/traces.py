"""Replays of public LLM serving traces: Mooncake JSONL and Azure (Splitwise) CSV.

Both formats give arrival times and token counts, never text; the prompts are synthesised
(``bench.prompts``) so that their token counts are exact under the simulator and, for Mooncake,
so that requests with equal leading ``hash_ids`` share exactly that prompt prefix.

Common options: ``rate_multiplier`` divides every arrival time (2.0 replays twice as fast);
``duration_s`` drops arrivals at or after that many seconds (after scaling); ``limit`` keeps
the first that many requests; ``token_scale`` multiplies every length (and the Mooncake block
size, so the prefix structure is kept) to make a replay cheaper; ``max_model_len`` cuts
lengths to fit (:func:`~switchyard.bench.spec.fit_lengths`; ``Workload.clipped`` counts them);
``labels`` gives the tenant, class, model, kind and streaming of the requests, one set or
weighted sets drawn per request with ``seed``; ``exact_output`` sends ``ignore_eos`` so the
engine generates the trace's output length, as the trace recorded it.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from switchyard.bench.prompts import SynthText, block_key, unique_key
from switchyard.bench.spec import Labels, RequestSpec, Workload, WorkloadError, cut_prompt, fit_lengths, weighted

LabelChoice = Labels | Sequence[tuple[Labels, float]]
#: Labels of a replay's requests when the caller gives none.
DEFAULT_LABELS = Labels()


class _MooncakeRow(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_MOONCAKE = msgspec.json.Decoder(_MooncakeRow)
_EPOCH = datetime(1970, 1, 1)


@dataclass(frozen=True, slots=True)
class _Row:
    """One parsed trace row: arrival (s, unscaled), prompt recipe, output tokens, prefix group."""

    time_s: float
    prompt: SynthText
    output: int
    group: str | None


def _check_common(rate_multiplier: float, token_scale: float, limit: int | None) -> None:
    if rate_multiplier <= 0:
        raise WorkloadError(f"rate_multiplier must be > 0, got {rate_multiplier}")
    if token_scale <= 0:
        raise WorkloadError(f"token_scale must be > 0, got {token_scale}")
    if limit is not None and limit < 0:
        raise WorkloadError(f"limit must be >= 0, got {limit}")


def _scaled(n: int, token_scale: float) -> int:
    return n if token_scale == 1.0 else max(1, round(n * token_scale))


def _build(rows: list[_Row], *, source: dict[str, Any], rate_multiplier: float, duration_s: float | None,
           limit: int | None, seed: int, max_model_len: int | None, labels: LabelChoice,
           exact_output: bool) -> Workload:
    """Schedule parsed rows: relative, scaled arrivals, the duration cap and limit, labels, clipping."""
    rows = sorted(rows, key=lambda r: r.time_s)  # stable: equal times keep file order
    t0 = rows[0].time_s if rows else 0.0
    # The offered window: the duration cap, or where the trace (or the limit) ends if sooner.
    end = (rows[-1].time_s - t0) / rate_multiplier if rows else 0.0
    kept: list[tuple[float, _Row]] = []
    for row in rows:
        arrival = (row.time_s - t0) / rate_multiplier
        if duration_s is not None and arrival >= duration_s:
            break
        if limit is not None and len(kept) >= limit:
            end = kept[-1][0] if kept else 0.0
            break
        kept.append((arrival, row))
    choices, weights = weighted(labels)
    if exact_output:
        choices = [replace(c, extra_body={**c.extra_body, "ignore_eos": True}) for c in choices]
    picks = np.random.default_rng(seed).choice(len(choices), size=len(kept), p=weights)
    specs: list[RequestSpec] = []
    clipped = 0
    for i, ((arrival, row), pick) in enumerate(zip(kept, picks.tolist(), strict=True)):
        lab = choices[pick]
        prompt_tokens, output = fit_lengths(row.prompt.tokens, row.output, lab.kind, max_model_len)
        prompt = row.prompt
        if (prompt_tokens, output) != (prompt.tokens, row.output):
            clipped += 1
            prompt = cut_prompt(prompt, prompt_tokens)
        specs.append(RequestSpec(i, arrival, prompt, output, lab, row.group))
    source = {**source, "rate_multiplier": rate_multiplier, "duration_cap_s": duration_s, "limit": limit,
              "seed": seed, "max_model_len": max_model_len, "exact_output": exact_output}
    return Workload(tuple(specs), min(duration_s, end) if duration_s is not None else end, source, clipped)


def mooncake(path: str | Path, *, rate_multiplier: float = 1.0, duration_s: float | None = None,
             limit: int | None = None, seed: int = 0, block_tokens: int = 512, token_scale: float = 1.0,
             max_model_len: int | None = None, labels: LabelChoice = DEFAULT_LABELS,
             exact_output: bool = True) -> Workload:
    """A replay of a Mooncake trace (JSON lines: ``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``).

    Each ``hash_ids`` entry is one block of ``block_tokens`` prompt tokens whose text is derived
    from the id alone (and ``seed``), so equal ids give equal text and equal leading runs of ids
    share exactly that prefix; the last block holds ``input_length - block_tokens*(n-1)`` tokens.
    ``output_length`` becomes ``max_tokens``. A request's ``prefix_group`` is its first two ids
    (a conversation's opening, in the conversation trace). See the module docstring for the
    other options; ``token_scale`` scales ``block_tokens`` and the last block alike.

    Raises:
        WorkloadError: A row is malformed (the message names the file and line).
    """
    _check_common(rate_multiplier, token_scale, limit)
    if block_tokens < 1:
        raise WorkloadError(f"block_tokens must be >= 1, got {block_tokens}")
    path = Path(path)
    block = _scaled(block_tokens, token_scale)
    rows: list[_Row] = []
    with path.open("rb") as lines:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = _MOONCAKE.decode(line)
            except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
                raise WorkloadError(f"{path}:{lineno}: not a Mooncake row ({exc})") from None
            ids, length = rec.hash_ids, rec.input_length
            where = f"{path}:{lineno}"
            if not ids or length < 1 or rec.output_length < 0 or rec.timestamp < 0:
                raise WorkloadError(f"{where}: need non-empty hash_ids, input_length >= 1, output_length >= 0 "
                                    "and timestamp >= 0")
            last = length - block_tokens * (len(ids) - 1)
            if not 0 < last <= block_tokens:
                raise WorkloadError(f"{where}: input_length {length} does not fit {len(ids)} blocks of "
                                    f"{block_tokens} tokens")
            if min(ids) < 0:
                raise WorkloadError(f"{where}: hash_ids must be >= 0")
            segments = [(block_key(b), block) for b in ids]
            segments[-1] = (segments[-1][0], min(block, _scaled(last, token_scale)))
            group = f"mooncake:{ids[0]}" if len(ids) == 1 else f"mooncake:{ids[0]}.{ids[1]}"
            rows.append(_Row(rec.timestamp / 1000.0, SynthText(tuple(segments), seed),
                             _scaled(max(rec.output_length, 1), token_scale), group))
    source = {"source": "mooncake", "path": str(path), "block_tokens": block_tokens, "token_scale": token_scale}
    return _build(rows, source=source, rate_multiplier=rate_multiplier, duration_s=duration_s, limit=limit,
                  seed=seed, max_model_len=max_model_len, labels=labels, exact_output=exact_output)


def _parse_time(value: str) -> float:
    """Seconds since the epoch of an Azure ``TIMESTAMP`` (``2023-11-16 18:17:03.9799600``).

    Python 3.11 reads at most six fractional digits; the trace has seven, read here exactly. A
    timezone suffix, where present, is honoured; a time without one is taken as UTC (only
    differences between rows matter).
    """
    text = value.strip()
    head, dot, frac = text.partition(".")
    digits, tail = frac, ""
    for i, ch in enumerate(frac):
        if not ch.isdigit():
            digits, tail = frac[:i], frac[i:]
            break
    moment = datetime.fromisoformat(head + tail if dot else text)
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC).replace(tzinfo=None)
    seconds = (moment - _EPOCH).total_seconds()
    return seconds + (int(digits) / 10 ** len(digits) if digits else 0.0)


def azure(path: str | Path, *, rate_multiplier: float = 1.0, duration_s: float | None = None,
          limit: int | None = None, seed: int = 0, token_scale: float = 1.0, max_model_len: int | None = None,
          labels: LabelChoice = DEFAULT_LABELS, exact_output: bool = True) -> Workload:
    """A replay of an Azure LLM inference trace (CSV: ``TIMESTAMP``, ``ContextTokens``,
    ``GeneratedTokens``).

    Arrivals are relative to the first row's time. Each request gets a prompt of
    ``ContextTokens`` tokens of its own text (unique per row, file and ``seed``: the trace says
    nothing about shared prefixes) and ``max_tokens = GeneratedTokens``. See the module
    docstring for the other options.

    Raises:
        WorkloadError: The header lacks a column or a row is malformed (naming file and line).
    """
    _check_common(rate_multiplier, token_scale, limit)
    path = Path(path)
    rows: list[_Row] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise WorkloadError(f"{path}:1: missing column(s) {', '.join(sorted(missing))}")
        for rec in reader:
            where = f"{path}:{reader.line_num}"
            if None in rec.values():
                raise WorkloadError(f"{where}: too few fields")
            try:
                moment = _parse_time(rec["TIMESTAMP"])
                context, generated = int(rec["ContextTokens"]), int(rec["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise WorkloadError(f"{where}: {exc}") from None
            if context < 0 or generated < 0:
                raise WorkloadError(f"{where}: token counts must be >= 0")
            key = unique_key("azure", path.name, seed, len(rows))
            prompt = SynthText(((key, _scaled(max(context, 1), token_scale)),), seed)
            rows.append(_Row(moment, prompt, _scaled(max(generated, 1), token_scale), None))
    source = {"source": "azure", "path": str(path), "token_scale": token_scale}
    return _build(rows, source=source, rate_multiplier=rate_multiplier, duration_s=duration_s, limit=limit,
                  seed=seed, max_model_len=max_model_len, labels=labels, exact_output=exact_output)
