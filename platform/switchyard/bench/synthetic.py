"""Synthetic workloads: Poisson and bursty arrivals over a weighted mix of request templates.

Every draw comes from one ``numpy.random.Generator`` (PCG64) seeded with ``seed``, so a seed
gives the same schedule, labels and lengths on every machine. A Poisson process on a window is
drawn as its count (Poisson-distributed) and then that many uniform times, sorted: the same
distribution as summing exponential gaps, in a few vectorised calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from switchyard.bench.prompts import Kind, SynthText, unique_key
from switchyard.bench.spec import Labels, RequestSpec, Workload, WorkloadError, cut_prompt, fit_lengths


@dataclass(frozen=True, slots=True)
class RequestTemplate:
    """One kind of request in a synthetic mix.

    Lengths are drawn uniformly from the inclusive ranges. With ``shared_prefix_tokens``, each
    request also starts with one of ``prefix_groups`` shared prefixes (a system prompt, a
    document; drawn uniformly) of that many tokens, before its own ``prompt_tokens``.

    Attributes:
        tenant: Tenant label (mapped to an API key by the load generator's target).
        request_class: Class label for the report.
        model: The ``model`` sent.
        weight: Relative frequency in the mix.
        prompt_tokens: ``(low, high)`` tokens of the request's own prompt text.
        output_tokens: ``(low, high)`` for ``max_tokens``.
        stream: Ask for server-sent events.
        kind: ``chat`` or ``completion``.
        shared_prefix_tokens: Tokens of the shared prefix (0: none).
        prefix_groups: How many distinct shared prefixes this template uses.
        name: Names the template's prefix groups (default: its position in the mix).
        extra_body: More request body fields.
    """

    tenant: str = "default"
    request_class: str = "standard"
    model: str = "auto"
    weight: float = 1.0
    prompt_tokens: tuple[int, int] = (128, 1024)
    output_tokens: tuple[int, int] = (16, 256)
    stream: bool = True
    kind: Kind = "chat"
    shared_prefix_tokens: int = 0
    prefix_groups: int = 1
    name: str = ""
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def labels(self, exact_output: bool) -> Labels:
        """The labels of this template's requests."""
        extra = {**self.extra_body, "ignore_eos": True} if exact_output else dict(self.extra_body)
        return Labels(self.tenant, self.request_class, self.model, self.kind, self.stream, extra)

    def check(self, where: str) -> None:
        """Raise ``WorkloadError`` for impossible parameters."""
        (p_lo, p_hi), (o_lo, o_hi) = self.prompt_tokens, self.output_tokens
        problems = []
        if self.weight < 0:
            problems.append("weight must be >= 0")
        if not 0 <= p_lo <= p_hi or p_hi + self.shared_prefix_tokens < 1:
            problems.append(f"prompt_tokens {self.prompt_tokens} must be 0 <= low <= high (and a prompt non-empty)")
        if not 1 <= o_lo <= o_hi:
            problems.append(f"output_tokens {self.output_tokens} must be 1 <= low <= high")
        if self.shared_prefix_tokens < 0 or self.prefix_groups < 1:
            problems.append("shared_prefix_tokens must be >= 0 and prefix_groups >= 1")
        if problems:
            raise WorkloadError(f"{where}: " + "; ".join(problems))


def _check_mix(mix: Sequence[RequestTemplate]) -> np.ndarray[Any, np.dtype[np.float64]]:
    if not mix:
        raise WorkloadError("mix: needs at least one template")
    for i, template in enumerate(mix):
        template.check(f"mix[{i}]")
    weights = np.array([t.weight for t in mix], dtype=np.float64)
    total = float(weights.sum())
    if total <= 0:
        raise WorkloadError("mix: the weights are all 0")
    normalised: np.ndarray[Any, np.dtype[np.float64]] = weights / total
    return normalised


def _poisson_times(rng: np.random.Generator, rate: float, start: float, end: float) -> np.ndarray[Any, Any]:
    count = rng.poisson(rate * (end - start)) if rate > 0 and end > start else 0
    return np.sort(rng.uniform(start, end, count))


def _synthesize(times: np.ndarray[Any, Any], mix: Sequence[RequestTemplate], rng: np.random.Generator, *,
                source: dict[str, Any], seed: int, duration_s: float, max_model_len: int | None,
                exact_output: bool, phases: tuple[tuple[float, float, str], ...] = ()) -> Workload:
    """Specs for arrival ``times``: a template per request, then its lengths and prefix group."""
    weights = _check_mix(mix)
    n = len(times)
    picks = rng.choice(len(mix), size=n, p=weights)
    own = np.zeros(n, dtype=np.int64)
    outputs = np.zeros(n, dtype=np.int64)
    groups = np.zeros(n, dtype=np.int64)
    for t, template in enumerate(mix):
        sel = picks == t
        count = int(sel.sum())
        own[sel] = rng.integers(template.prompt_tokens[0], template.prompt_tokens[1], count, endpoint=True)
        outputs[sel] = rng.integers(template.output_tokens[0], template.output_tokens[1], count, endpoint=True)
        groups[sel] = rng.integers(0, template.prefix_groups, count)
    labels = [t.labels(exact_output) for t in mix]
    names = [t.name or str(i) for i, t in enumerate(mix)]
    name = str(source["source"])
    specs: list[RequestSpec] = []
    clipped = 0
    rows = zip(times.tolist(), picks.tolist(), own.tolist(), outputs.tolist(), groups.tolist(), strict=True)
    for i, (arrival, pick, own_tokens, output, group) in enumerate(rows):
        template = mix[pick]
        segments: list[tuple[int, int]] = []
        prefix_group = None
        if template.shared_prefix_tokens:
            prefix_group = f"{names[pick]}:{group}"
            segments.append((unique_key("prefix", seed, names[pick], group), template.shared_prefix_tokens))
        if own_tokens:
            segments.append((unique_key(name, seed, i), own_tokens))
        prompt = SynthText(tuple(segments), seed)
        lab = labels[pick]
        prompt_tokens, max_tokens = fit_lengths(prompt.tokens, output, lab.kind, max_model_len)
        if (prompt_tokens, max_tokens) != (prompt.tokens, output):
            clipped += 1
            prompt = cut_prompt(prompt, prompt_tokens)
        specs.append(RequestSpec(i, arrival, prompt, max_tokens, lab, prefix_group))
    source = {**source, "seed": seed, "duration_s": duration_s, "max_model_len": max_model_len,
              "exact_output": exact_output, "mix": [_describe(t) for t in mix]}
    return Workload(tuple(specs), duration_s, source, clipped, phases)


def _describe(template: RequestTemplate) -> dict[str, Any]:
    return {"tenant": template.tenant, "class": template.request_class, "model": template.model,
            "weight": template.weight, "prompt_tokens": list(template.prompt_tokens),
            "output_tokens": list(template.output_tokens), "stream": template.stream, "kind": template.kind,
            "shared_prefix_tokens": template.shared_prefix_tokens, "prefix_groups": template.prefix_groups}


def _check_window(duration_s: float, *rates: float) -> None:
    if duration_s <= 0:
        raise WorkloadError(f"duration_s must be > 0, got {duration_s}")
    if any(r < 0 for r in rates):
        raise WorkloadError(f"rates must be >= 0, got {rates}")


def poisson(rate_per_s: float, duration_s: float, mix: Sequence[RequestTemplate], seed: int, *,
            max_model_len: int | None = None, exact_output: bool = True) -> Workload:
    """Poisson arrivals at ``rate_per_s`` for ``duration_s`` seconds over ``mix``.

    Args:
        rate_per_s: Mean arrivals per second.
        duration_s: Length of the window; every arrival falls in ``[0, duration_s)``.
        mix: Weighted request templates.
        seed: Seeds every draw.
        max_model_len: Cut lengths to fit it (see ``fit_lengths``).
        exact_output: Send ``ignore_eos`` so outputs have the drawn length.
    """
    _check_window(duration_s, rate_per_s)
    rng = np.random.default_rng(seed)
    times = _poisson_times(rng, rate_per_s, 0.0, duration_s)
    return _synthesize(times, mix, rng, source={"source": "poisson", "rate_per_s": rate_per_s}, seed=seed,
                       duration_s=duration_s, max_model_len=max_model_len, exact_output=exact_output)


def burst_phases(duration_s: float, rng: np.random.Generator, *, mean_calm_s: float, mean_burst_s: float,
                 markov: bool) -> list[tuple[float, float, str]]:
    """The calm and burst phases covering ``[0, duration_s)``, calm first.

    With ``markov``, phase lengths are exponential with the given means (a two-state
    continuous-time Markov chain); otherwise they are exactly the means (a square wave).
    """
    phases: list[tuple[float, float, str]] = []
    start, state = 0.0, "calm"
    while start < duration_s:
        mean = mean_calm_s if state == "calm" else mean_burst_s
        length = float(rng.exponential(mean)) if markov else mean
        end = min(start + length, duration_s)
        phases.append((start, end, state))
        start, state = end, ("burst" if state == "calm" else "calm")
    return phases


def bursty(base_rate_per_s: float, burst_rate_per_s: float, duration_s: float, mix: Sequence[RequestTemplate],
           seed: int, *, mean_calm_s: float = 20.0, mean_burst_s: float = 5.0, markov: bool = True,
           max_model_len: int | None = None, exact_output: bool = True) -> Workload:
    """Bursty arrivals: a Markov-modulated Poisson process with a calm and a burst state.

    Arrivals are Poisson at ``base_rate_per_s`` in calm phases and at ``burst_rate_per_s`` in
    bursts. The run starts calm. With ``markov=True`` (an MMPP-2) phase lengths are exponential
    with means ``mean_calm_s`` and ``mean_burst_s``; with ``markov=False`` they are exactly those
    lengths (an on/off square wave). The mean offered rate is about
    ``(base*calm + burst*burst_s) / (calm + burst_s)``. ``Workload.phases`` records the phases.

    Args:
        base_rate_per_s: Arrivals per second while calm (0 for a pure on/off source).
        burst_rate_per_s: Arrivals per second during a burst.
        duration_s: Length of the window.
        mix: Weighted request templates.
        seed: Seeds every draw (phases, arrivals, labels, lengths).
        mean_calm_s: Mean (or exact) length of a calm phase, > 0.
        mean_burst_s: Mean (or exact) length of a burst, > 0.
        markov: Exponential phase lengths (True) or fixed ones (False).
        max_model_len: Cut lengths to fit it.
        exact_output: Send ``ignore_eos`` so outputs have the drawn length.
    """
    _check_window(duration_s, base_rate_per_s, burst_rate_per_s)
    if mean_calm_s <= 0 or mean_burst_s <= 0:
        raise WorkloadError("mean_calm_s and mean_burst_s must be > 0")
    rng = np.random.default_rng(seed)
    phases = burst_phases(duration_s, rng, mean_calm_s=mean_calm_s, mean_burst_s=mean_burst_s, markov=markov)
    rates = {"calm": base_rate_per_s, "burst": burst_rate_per_s}
    parts = [_poisson_times(rng, rates[state], start, end) for start, end, state in phases]
    times = np.concatenate(parts) if parts else np.zeros(0)
    source = {"source": "bursty", "base_rate_per_s": base_rate_per_s, "burst_rate_per_s": burst_rate_per_s,
              "mean_calm_s": mean_calm_s, "mean_burst_s": mean_burst_s, "markov": markov}
    return _synthesize(times, mix, rng, source=source, seed=seed, duration_s=duration_s,
                       max_model_len=max_model_len, exact_output=exact_output, phases=tuple(phases))
