"""Workloads for ``switchyard bench``: what to send and when, in one import.

A workload is a :class:`Workload` of :class:`RequestSpec` in arrival order. Sources:

- :func:`mooncake` and :func:`azure` replay public traces (two ship in ``switchyard/bench/data``), with a
  rate multiplier, a duration cap, a limit and a token scale;
- :func:`poisson` and :func:`bursty` draw synthetic arrivals over a weighted mix of
  :class:`RequestTemplate` (tenants, classes, models, length ranges, shared prefixes);
- :func:`merge` interleaves several into one schedule.

Prompt text is exact in tokens under ``switchyard.simtext.tokens`` and built only when a request is
sent (``RequestSpec.encode``); see ``bench.prompts`` for how shared prefixes stay shared.
"""

from switchyard.bench.prompts import Kind, LiteralText, PromptText, SynthText, prompt_overhead_tokens
from switchyard.bench.spec import Labels, RequestSpec, Workload, WorkloadError, fit_lengths, merge
from switchyard.bench.synthetic import RequestTemplate, burst_phases, bursty, poisson
from switchyard.bench.traces import azure, mooncake

__all__ = [
    "Kind",
    "Labels",
    "LiteralText",
    "PromptText",
    "RequestSpec",
    "RequestTemplate",
    "SynthText",
    "Workload",
    "WorkloadError",
    "azure",
    "burst_phases",
    "bursty",
    "fit_lengths",
    "merge",
    "mooncake",
    "poisson",
    "prompt_overhead_tokens",
]
