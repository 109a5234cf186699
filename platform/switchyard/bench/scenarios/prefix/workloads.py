"""The prefix scenario's two workloads: the Mooncake conversation trace, and agent sessions of many tenants.

The two have very different prefix structures, so that a routing result is not tuned to one trace:

- ``mooncake``: the conversation trace's ``hash_ids`` (chat sessions whose turns share their
  conversation's opening; a few prefixes shared by many requests, most by a handful).
- ``agents`` (:func:`agent_sessions`, made here from a seed): tool-using agent sessions whose context
  grows turn by turn. Every request opens with one long system prompt that *every* tenant shares, then
  its tenant's own instructions, then the session's task, then the whole history so far: each turn
  re-sends everything before it plus the assistant's last tool call and the tool's output. A session's
  turns come a few seconds apart (the model's answer, then the tool's run), so the longest prefixes are
  one session's own and grow with each turn, while the shortest is everyone's.

Both are in the scenario's scaled tokens (the Mooncake trace at ``token_scale``; the agents workload is
made at that scale directly).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from switchyard.bench.prompts import SynthText, unique_key
from switchyard.bench.spec import Labels, RequestSpec, Workload, WorkloadError, cut_prompt, fit_lengths

#: The workloads, by ``--workload`` name.
WORKLOADS = ("mooncake", "agents")
#: The traces shipped with the package (``switchyard/bench/data``, with their attribution and licence).
SHIPPED_TRACES = Path(__file__).resolve().parents[2] / "data"


def default_trace() -> Path:
    """The Mooncake conversation trace shipped with the package: found wherever switchyard is installed,
    whatever the working folder."""
    return SHIPPED_TRACES / "mooncake_conversation.jsonl"


@dataclass(frozen=True, slots=True)
class AgentShape:
    """The agents workload's shape (token counts are the scenario's scaled tokens).

    Attributes:
        sessions_per_s: Sessions started per second (Poisson).
        tenants: Tenants, each with instructions of its own after the shared system prompt.
        system_tokens: The system prompt every tenant shares.
        tenant_tokens: Each tenant's own instructions.
        task_tokens: A session's task, drawn uniformly from this range.
        turns: Turns per session, drawn uniformly from this range (inclusive).
        call_tokens: The assistant's tool call a turn adds to the history (uniform range); also the turn's
            ``max_tokens``.
        tool_tokens: The tool's output a turn adds (log-uniform range).
        gap_s: Seconds between a session's turns (uniform range): the answer, then the tool's run.
        tenant_skew: Zipf exponent of how sessions are spread over tenants (0: evenly).
    """

    sessions_per_s: float = 1.0
    tenants: int = 32
    system_tokens: int = 768
    tenant_tokens: int = 256
    task_tokens: tuple[int, int] = (64, 192)
    turns: tuple[int, int] = (4, 14)
    call_tokens: tuple[int, int] = (24, 96)
    tool_tokens: tuple[int, int] = (48, 512)
    gap_s: tuple[float, float] = (2.5, 7.0)
    tenant_skew: float = 1.0


def agent_sessions(shape: AgentShape, duration_s: float, seed: int, *, labels: Labels | None = None,
                   max_model_len: int | None = None) -> Workload:
    """Agent sessions started over ``duration_s`` seconds (see the module doc), deterministic in ``seed``.

    Turns scheduled at or after ``duration_s`` are left out (a session started late is cut short), as a
    trace replay's duration cap does. Each request's ``prefix_group`` is its session
    (``agents:<tenant>.<session>``). Prompts too long for ``max_model_len`` lose their end
    (:func:`~switchyard.bench.spec.fit_lengths`; ``Workload.clipped`` counts them).

    Raises:
        WorkloadError: A parameter is out of range.
    """
    if duration_s <= 0 or shape.sessions_per_s <= 0 or shape.tenants < 1:
        raise WorkloadError("agents: duration, session rate and tenants must be positive")
    if shape.turns[0] < 1 or shape.turns[0] > shape.turns[1]:
        raise WorkloadError(f"agents: turns must be a range of at least 1, got {shape.turns}")
    labels = labels or Labels()
    rng = np.random.default_rng(seed)
    system = (unique_key("agents-system", seed), shape.system_tokens)
    tenant_weights = 1.0 / np.arange(1, shape.tenants + 1) ** shape.tenant_skew
    tenant_weights /= tenant_weights.sum()
    rows: list[tuple[float, SynthText, int, str]] = []
    start, session = 0.0, 0
    while True:
        start += float(rng.exponential(1.0 / shape.sessions_per_s))
        if start >= duration_s:
            break
        tenant = int(rng.choice(shape.tenants, p=tenant_weights))
        history = [system, (unique_key("agents-tenant", seed, tenant), shape.tenant_tokens),
                   (unique_key("agents-task", seed, session), int(rng.integers(*shape.task_tokens, endpoint=True)))]
        at, call = start, 0
        for turn in range(int(rng.integers(shape.turns[0], shape.turns[1], endpoint=True))):
            if turn:
                at += float(rng.uniform(*shape.gap_s))
                history.append((unique_key("agents-call", seed, session, turn), call))
                tool = int(np.exp(rng.uniform(np.log(shape.tool_tokens[0]), np.log(shape.tool_tokens[1]))))
                history.append((unique_key("agents-tool", seed, session, turn), tool))
            call = int(rng.integers(*shape.call_tokens, endpoint=True))
            if at >= duration_s:
                break
            rows.append((at, SynthText(tuple(history), seed), call, f"agents:{tenant}.{session}"))
        session += 1
    rows.sort(key=lambda r: r[0])
    specs: list[RequestSpec] = []
    clipped = 0
    for i, (at, prompt, output, group) in enumerate(rows):
        tokens, output_fit = fit_lengths(prompt.tokens, output, labels.kind, max_model_len)
        if (tokens, output_fit) != (prompt.tokens, output):
            clipped += 1
            prompt = cut_prompt(prompt, tokens)
        specs.append(RequestSpec(i, at, prompt, output_fit, labels, group))
    source = {"source": "agents", "sessions": session, "sessions_per_s": shape.sessions_per_s,
              "tenants": shape.tenants, "system_tokens": shape.system_tokens, "tenant_tokens": shape.tenant_tokens,
              "turns": list(shape.turns), "tool_tokens": list(shape.tool_tokens), "gap_s": list(shape.gap_s),
              "seed": seed, "max_model_len": max_model_len}
    return Workload(tuple(specs), duration_s, source, clipped)
