"""What calibration measures (timings; ``facts`` reads the engine's limits), and how each
measurement becomes samples for the fit.

* **TTFT against prompt length**: one request at a time on the idle engine, ``max_tokens=1``.
* **Prefix-hit speed-up**: a prompt of whole cached blocks plus a short suffix, sent cold and
  then warm (same prefix, new suffix); the hits are read from ``vllm:prefix_cache_hits``. The
  warm TTFTs are not fitted: they test the fit (measured against predicted speed-up), since
  they also carry per-prompt-token costs outside the engine step (request parsing, block
  hashing) that the step-time model does not have.
* **TTFT on a busy engine**: short probes sent one by one, at random moments, while a few
  requests decode. An idle engine can answer slower than a busy one (seen on vLLM's CPU
  backend, whose processes wait differently when there is no work); comparing the two
  splits the fitted frontend overhead into the part every request pays and the idle
  engine's wake-up.
* **ITL against batch size**: ``batch`` requests at once, equal prompt and output lengths;
  the mean inter-token latency over the window where the most of them decode together, with
  short and with long prompts (two context sizes). When fewer run together than were sent,
  twice, the engine's ``max_num_seqs`` has been found and larger batches are skipped.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from switchyard.sim.calibrate.client import EngineClient, EngineError, StreamResult, metric_total
from switchyard.sim.calibrate.fit import DecodeSample, PrefillSample


@dataclass(frozen=True)
class Plan:
    """The measurements of one calibration run."""

    prefill_lengths: list[int]
    prefill_reps: int
    decode_reps: int
    prefix_blocks: list[int]
    prefix_suffix: int
    decode_batches: list[int]
    long_prompt_batches: list[int]
    short_prompt: int
    long_prompt: int
    decode_output: int
    busy_batches: list[int]
    busy_probes: int
    busy_prompt: int
    #: Cold/warm pairs per prefix size, each on a fresh prefix (their medians are kept: one pair is noise on a
    #: busy machine, where a 688-token prompt was once measured slower warm than cold).
    prefix_reps: int = 3


@dataclass(frozen=True)
class PrefixHit:
    """Cold/warm pairs of one prefix size (medians): the same cached prefix, a different suffix."""

    prompt_tokens: int
    cached_tokens: int
    cold_ttft_s: float
    warm_ttft_s: float


@dataclass(frozen=True)
class BusyProbe:
    """TTFT of a short request that arrived while ``batch`` others were decoding."""

    batch: int
    kv_tokens: float
    prompt_tokens: int
    ttft_s: float


@dataclass
class Measurements:
    """Everything measured: fit samples (medians over repetitions) and what the report shows.

    Attributes:
        prefill: Median TTFT per prompt length.
        decode: Median ITL per (batch, prompt length).
        raw_prefill: TTFT samples before taking medians.
        raw_decode: ITL samples before taking medians.
    """

    prefill: list[PrefillSample] = field(default_factory=list)
    decode: list[DecodeSample] = field(default_factory=list)
    raw_prefill: int = 0
    raw_decode: int = 0
    prefix_hits: list[PrefixHit] = field(default_factory=list)
    busy: list[BusyProbe] = field(default_factory=list)
    max_concurrency: int = 0
    saturated_at: int | None = None
    requests: int = 0


def make_plan(max_model_len: int, block_size: int, budget: int, quick: bool) -> Plan:
    """Choose prompt lengths and batch sizes that fit the engine's limits.

    Raises:
        ValueError: The context window is too small to calibrate (under 64 tokens).
    """
    if max_model_len < 64:
        raise ValueError(f"calibrate: max_model_len {max_model_len} is too small (need >= 64)")
    top = min(max_model_len - 2, budget)
    # Log-spaced lengths find a GPU's flat, bandwidth-bound stretch of short prompts;
    # evenly spaced ones pin the slope (and curvature) of the compute-bound rest.
    n_geo, n_lin = (8, 4) if quick else (10, 7)
    geo = [round(16 * (top / 16) ** (i / (n_geo - 1))) for i in range(n_geo)]
    lin = [round(top * (i + 1) / n_lin) for i in range(n_lin)]
    lengths = sorted({max(2, v) for v in geo + lin})
    suffix = 16
    most_blocks = (top - suffix) // block_size
    if most_blocks >= 1:
        count = min(most_blocks, 3 if quick else 5)
        blocks = sorted({max(1, round(most_blocks * (i + 1) / count)) for i in range(count)})
    else:
        blocks = []
    output = 64 if quick else 128
    output = min(output, max_model_len // 4)
    long_prompt = max(16, min(512, (max_model_len - output - 1) * 3 // 4))
    batches = [1, 2, 4, 8, 16] if quick else [1, 2, 4, 8, 16, 32, 64]
    return Plan(prefill_lengths=lengths, prefill_reps=3 if quick else 5,
                decode_reps=2 if quick else 3, prefix_blocks=blocks, prefix_suffix=suffix,
                decode_batches=batches, long_prompt_batches=batches, short_prompt=16,
                long_prompt=long_prompt, decode_output=output,
                busy_batches=[1, 2, 4] if quick else [1, 2, 4, 8], busy_probes=4 if quick else 6,
                busy_prompt=min(64, top))


class Prompts:
    """Random token-id prompts that share nothing unless asked (no accidental cache hits)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        # Stay clear of special tokens, which sit at both ends of most vocabularies.
        self.lo = min(vocab_size - 1, max(3, vocab_size // 10))
        self.hi = max(self.lo + 1, vocab_size * 9 // 10)

    def make(self, n: int) -> list[int]:
        """``n`` random token ids."""
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]


async def _complete(client: EngineClient, prompt: list[int], max_tokens: int) -> StreamResult:
    """``client.complete``, tried once more after a broken connection (a measurement, unlike a
    replayed request, may be repeated)."""
    try:
        return await client.complete(prompt, max_tokens)
    except EngineError as exc:
        if "broke" not in str(exc) and "cannot reach" not in str(exc):
            raise
        await asyncio.sleep(0.5)
        return await client.complete(prompt, max_tokens)


async def _cache_hits(client: EngineClient) -> float | None:
    text = await client.text("/metrics")
    return metric_total(text, "vllm:prefix_cache_hits") if text else None


async def measure(client: EngineClient, plan: Plan, prompts: Prompts, block_size: int,
                  log: Callable[[str], None]) -> Measurements:
    """Run the plan against an otherwise idle engine."""
    out = Measurements()
    for _ in range(3):  # warm-up: first requests pay one-off costs (allocations, caches)
        await _complete(client, prompts.make(64), 8)
        out.requests += 1

    log(f"calibrate: TTFT at {len(plan.prefill_lengths)} prompt lengths x {plan.prefill_reps}")
    ttfts: dict[int, list[float]] = {}
    for _ in range(plan.prefill_reps):
        for n in plan.prefill_lengths:
            r = await _complete(client, prompts.make(n), 1)
            ttfts.setdefault(n, []).append(r.ttft)
            out.requests += 1

    log(f"calibrate: prefix-cache hits at {plan.prefix_blocks} blocks of {block_size}")
    for blocks in plan.prefix_blocks:
        colds: list[float] = []
        warms: list[float] = []
        hits: list[int] = []
        length = blocks * block_size + plan.prefix_suffix
        for _ in range(plan.prefix_reps):
            prefix = prompts.make(blocks * block_size)  # a fresh prefix each time: the cold prompt is cold
            cold = prefix + prompts.make(plan.prefix_suffix)
            warm = prefix + prompts.make(plan.prefix_suffix)
            r_cold = await _complete(client, cold, 1)
            before = await _cache_hits(client)
            r_warm = await _complete(client, warm, 1)
            after = await _cache_hits(client)
            out.requests += 2
            if before is not None and after is not None:
                cached = int(after - before)
            elif r_warm.cached_tokens is not None:
                cached = r_warm.cached_tokens
            else:
                cached = blocks * block_size
            hits.append(max(0, min(cached, len(warm) - 1)))
            colds.append(r_cold.ttft)
            warms.append(r_warm.ttft)
        # The cold prompts are more prefill samples; the warm ones are kept out of the fit and
        # check it: their measured speed-up against the one the fitted model predicts.
        ttfts.setdefault(length, []).extend(colds)
        out.prefix_hits.append(PrefixHit(length, round(statistics.median(hits)), statistics.median(colds),
                                         statistics.median(warms)))
    out.prefill = [PrefillSample(n, 0, statistics.median(v)) for n, v in sorted(ttfts.items())]
    out.raw_prefill = sum(len(v) for v in ttfts.values())

    log(f"calibrate: ITL at batch sizes {plan.decode_batches} ({plan.decode_output} tokens, "
        f"prompts of {plan.short_prompt} and {plan.long_prompt}) x {plan.decode_reps}")
    itls: dict[tuple[int, int], list[DecodeSample]] = {}
    for _ in range(plan.decode_reps):
        for prompt_len, batches in ((plan.short_prompt, plan.decode_batches),
                                    (plan.long_prompt, plan.long_prompt_batches)):
            for batch in batches:
                if out.saturated_at is not None and batch > out.saturated_at:
                    continue
                for sample in await _decode_run(client, plan, prompts, prompt_len, batch, out,
                                                log):
                    itls.setdefault((sample.batch, prompt_len), []).append(sample)
    out.decode = [DecodeSample(key[0], statistics.median(d.kv_tokens for d in v),
                               statistics.median(d.itl_s for d in v))
                  for key, v in sorted(itls.items())]
    out.raw_decode = sum(len(v) for v in itls.values())

    log(f"calibrate: TTFT of {plan.busy_probes} probes while {plan.busy_batches} requests "
        "decode")
    step = {d.batch: d.itl_s for d in out.decode}
    idle_ttft = statistics.median(ttfts[min(ttfts)])
    for batch in plan.busy_batches:
        if out.saturated_at is not None and batch >= out.saturated_at:
            continue
        out.busy.extend(await _busy_probes(client, plan, prompts, batch,
                                           step.get(batch, min(step.values())), idle_ttft))
        out.requests += batch + plan.busy_probes
    return out


async def _decode_run(client: EngineClient, plan: Plan, prompts: Prompts, prompt_len: int,
                      batch: int, out: Measurements,
                      log: Callable[[str], None]) -> list[DecodeSample]:
    """Send ``batch`` requests at once; the decode samples of the clean runs.

    Fewer requests decoding together than were sent means ``max_num_seqs`` was reached, or
    that the client saw a stall (on a small machine the engine, its API server and this
    client share the CPUs, and a starved stream arrives in one burst). A real limit
    reproduces exactly, a stall does not: the run is repeated before a limit is believed,
    and a run whose tokens arrived in bursts is repeated and not used.
    """
    runs: list[DecodeRun] = []
    for _ in range(2):
        results = await asyncio.gather(*[_complete(client, prompts.make(prompt_len),
                                                         plan.decode_output)
                                          for _ in range(batch)])
        out.requests += batch
        run = decode_run(results)
        runs.append(run)
        if run.concurrency == batch and not run.bursty:
            break
    steady = [r for r in runs if not r.bursty]
    counts = {r.concurrency for r in steady}
    if (len(steady) == 2 and len(counts) == 1 and min(counts) < batch
            and out.max_concurrency <= min(counts)):
        out.saturated_at = steady[0].concurrency
        log(f"calibrate: only {out.saturated_at} of {batch} requests ran at once, twice "
            "(max_num_seqs)")
    clean = [r.sample for r in steady
             if r.sample is not None and r.concurrency in (batch, out.saturated_at)]
    if not clean:
        log(f"calibrate: a batch of {batch} was disturbed twice (concurrency "
            f"{[r.concurrency for r in runs]}, bursts {[r.bursty for r in runs]}); skipped")
    out.max_concurrency = max([out.max_concurrency, *(s.batch for s in clean)])
    return clean


async def _busy_probes(client: EngineClient, plan: Plan, prompts: Prompts, batch: int,
                       step_s: float, ttft_s: float) -> list[BusyProbe]:
    """Probe TTFTs while ``batch`` requests decode; one probe at a time, at random phases."""
    # Long enough to outlast every probe: a lead-in, then per probe a gap and a TTFT.
    tokens = int(16 + plan.busy_probes * (5 + 2 * ttft_s / step_s))
    background = [asyncio.ensure_future(_complete(client, prompts.make(plan.short_prompt), tokens))
                  for _ in range(batch)]
    probes: list[tuple[float, StreamResult]] = []
    try:
        await asyncio.sleep(8 * step_s)  # past the background's prefill, into its decode
        for _ in range(plan.busy_probes):
            await asyncio.sleep(step_s * prompts.rng.uniform(2.0, 4.0))
            if any(b.done() for b in background):
                break
            probes.append((time.perf_counter(),
                           await _complete(client, prompts.make(plan.busy_prompt), 1)))
        runs = await asyncio.gather(*background)
    finally:
        for b in background:
            b.cancel()
    out: list[BusyProbe] = []
    for sent, probe in probes:
        decoding = [r for r in runs if r.first_token_at <= sent and r.last_token_at > probe.first_token_at]
        if len(decoding) != batch:
            continue  # the background was not decoding all along: not a clean sample
        kv = sum(r.prompt_len + sum(1 for t in r.token_times() if t <= sent) for r in decoding)
        out.append(BusyProbe(batch, kv, probe.prompt_len, probe.ttft))
    return out


@dataclass(frozen=True)
class DecodeRun:
    """What one set of requests sent together shows about decoding.

    Attributes:
        sample: Mean ITL over the window where the most of them decoded together (None if
            there was no such window).
        concurrency: How many decoded together.
        bursty: The client received tokens in bursts (a stall: not a clean measurement).
    """

    sample: DecodeSample | None
    concurrency: int
    bursty: bool


#: A run whose chunks this often arrive within a tenth of the mean ITL of each other came in
#: bursts.
BURSTY_FRACTION = 0.2


def decode_run(results: list[StreamResult]) -> DecodeRun:
    """The decode sample of requests sent together, and how many of them decoded at once.

    The window is the longest stretch during which the most requests were between their
    first and last token; each request's mean ITL over it is its time span over its tokens
    there (robust to chunks that carry several tokens), and the sample is their mean.
    """
    events = sorted([(r.first_token_at, 1) for r in results] + [(r.last_token_at, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    best, w0, w1, level, start = 0, 0.0, 0.0, 0, 0.0
    for t, step in events:
        if step < 0 and level == best and best and t - start > w1 - w0:
            w0, w1 = start, t
        level += step
        if step > 0 and level >= best:
            if level > best:
                w0 = w1 = t
            best, start = level, t
    active = [r for r in results if r.first_token_at <= w0 and r.last_token_at >= w1]
    if not active or w1 <= w0:
        return DecodeRun(None, best, bursty=False)
    means: list[float] = []
    gaps: list[float] = []
    kv = 0.0
    mid = (w0 + w1) / 2
    stalled = False
    for r in active:
        ts = r.token_times()
        inside = [t for t in ts if w0 <= t <= w1]
        if len(inside) < 3 or inside[-1] <= inside[0]:
            return DecodeRun(None, best, bursty=True)
        means.append((inside[-1] - inside[0]) / (len(inside) - 1))
        # Gaps between chunks (a chunk carrying several tokens is the server catching up,
        # which the mean above absorbs; chunks arriving together are the client stalling).
        arrivals = [t for t, _ in r.chunks if w0 <= t <= w1]
        gaps.extend(b - a for a, b in itertools.pairwise(arrivals))
        kv += r.prompt_len + sum(1 for t in ts if t <= mid)
        # A stream that sat unread and then arrived at once decoded in no time, late.
        stalled |= r.last_token_at - r.first_token_at < 0.25 * (r.last_token_at - r.sent_at)
    typical = sum(means) / len(means)
    bursty = stalled or sum(1 for g in gaps if g < 0.1 * typical) > BURSTY_FRACTION * len(gaps)
    return DecodeRun(DecodeSample(len(active), kv, sum(means) / len(means)), best, bursty)
