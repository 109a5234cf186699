"""Workload sources: schedules (Poisson, bursty, trace replay), trace parsing, clipping."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import msgspec
import numpy as np
import pytest

from switchyard.bench.workload import (
    Labels,
    RequestTemplate,
    Workload,
    WorkloadError,
    azure,
    bursty,
    fit_lengths,
    merge,
    mooncake,
    poisson,
    prompt_overhead_tokens,
)
from switchyard.simtext.tokens import count_tokens, tokenize

DATA = Path(__file__).parent / "data"
MOONCAKE = DATA / "mooncake_small.jsonl"
AZURE = DATA / "azure_small.csv"

MIX = [
    RequestTemplate(tenant="acme", request_class="critical", model="large", weight=1,
                    prompt_tokens=(50, 100), output_tokens=(5, 10)),
    RequestTemplate(tenant="free", request_class="sheddable", model="auto", weight=3,
                    prompt_tokens=(10, 20), output_tokens=(1, 4), stream=False, kind="completion",
                    shared_prefix_tokens=200, prefix_groups=2),
]


def _arrivals(workload: Workload) -> np.ndarray:
    return np.array([s.arrival_s for s in workload.specs])


# --- Poisson ---------------------------------------------------------------------------------


def test_poisson_count_and_rate_within_statistical_bounds() -> None:
    rate, duration = 40.0, 100.0
    w = poisson(rate, duration, MIX, seed=11)
    expected = rate * duration
    assert abs(len(w) - expected) < 5 * math.sqrt(expected)  # 5 sigma of Poisson(4000)
    times = _arrivals(w)
    assert np.all(np.diff(times) >= 0)
    assert times.min() >= 0 and times.max() < duration
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.08)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential gaps: CV = 1
    per_second = np.bincount(times.astype(int), minlength=int(duration))
    assert per_second.var() / per_second.mean() == pytest.approx(1.0, abs=0.3)  # dispersion index
    assert [s.index for s in w.specs] == list(range(len(w)))
    assert w.duration_s == duration


def test_poisson_is_repeatable_and_seed_dependent() -> None:
    a, b, c = poisson(20, 10, MIX, seed=1), poisson(20, 10, MIX, seed=1), poisson(20, 10, MIX, seed=2)
    assert [(s.arrival_s, s.max_tokens, s.tenant) for s in a.specs] == \
        [(s.arrival_s, s.max_tokens, s.tenant) for s in b.specs]
    assert a.specs[0].prompt.text() == b.specs[0].prompt.text()
    assert [s.arrival_s for s in a.specs] != [s.arrival_s for s in c.specs]


def test_mix_weights_labels_and_lengths() -> None:
    w = poisson(100, 50, MIX, seed=3)
    free = [s for s in w.specs if s.tenant == "free"]
    assert len(free) / len(w) == pytest.approx(0.75, abs=0.04)
    for s in w.specs:
        if s.tenant == "acme":
            assert (s.request_class, s.model, s.kind, s.stream) == ("critical", "large", "chat", True)
            assert 50 <= s.prompt_tokens <= 100 and 5 <= s.max_tokens <= 10
            assert s.prefix_group is None
        else:
            assert (s.request_class, s.kind, s.stream) == ("sheddable", "completion", False)
            assert 210 <= s.prompt_tokens <= 220 and 1 <= s.max_tokens <= 4
            assert s.prefix_group in {"1:0", "1:1"}
    for s in w.specs[:40]:
        assert count_tokens(s.prompt.text()) == s.prompt_tokens
    # requests of one prefix group share the 200-token prefix; the two groups differ
    by_group: dict[str, list[list[int]]] = {}
    for s in free[:30]:
        assert s.prefix_group is not None
        by_group.setdefault(s.prefix_group, []).append(tokenize(s.prompt.text()))
    heads = {g: {tuple(t[:200]) for t in toks} for g, toks in by_group.items()}
    assert all(len(h) == 1 for h in heads.values())
    assert len(set().union(*heads.values())) == 2


def test_body_shapes() -> None:
    w = poisson(50, 5, MIX, seed=4)
    chat = next(s for s in w.specs if s.kind == "chat")
    body = msgspec.json.decode(chat.encode())
    assert body["model"] == "large" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == chat.max_tokens
    assert body["messages"] == [{"role": "user", "content": chat.prompt.text()}]
    completion = next(s for s in w.specs if s.kind == "completion")
    body = msgspec.json.decode(completion.encode())
    assert "stream" not in body and body["prompt"] == completion.prompt.text()


def test_template_validation() -> None:
    with pytest.raises(WorkloadError, match=r"mix\[0\]"):
        poisson(1, 1, [RequestTemplate(output_tokens=(0, 5))], seed=0)
    with pytest.raises(WorkloadError, match="at least one"):
        poisson(1, 1, [], seed=0)
    with pytest.raises(WorkloadError, match="duration_s"):
        poisson(1, 0, MIX, seed=0)


# --- bursty ----------------------------------------------------------------------------------


def test_on_off_bursts_have_the_square_wave_structure() -> None:
    w = bursty(0.0, 50.0, 100.0, MIX, seed=5, mean_calm_s=15.0, mean_burst_s=5.0, markov=False)
    assert [p[2] for p in w.phases[:4]] == ["calm", "burst", "calm", "burst"]
    assert w.phases[0][:2] == (0.0, 15.0) and w.phases[1][:2] == (15.0, 20.0)
    assert w.phases[-1][1] == 100.0
    bursts = [(a, b) for a, b, state in w.phases if state == "burst"]
    times = _arrivals(w)
    # nothing arrives while calm (base rate 0); each 5 s burst gets about 250
    assert all(any(a <= t < b for a, b in bursts) for t in times)
    for a, b in bursts:
        n = int(((times >= a) & (times < b)).sum())
        assert abs(n - 50 * (b - a)) < 5 * math.sqrt(50 * (b - a))


def test_markov_bursts_alternate_and_cover_the_window() -> None:
    w = bursty(2.0, 80.0, 300.0, MIX, seed=6, mean_calm_s=20.0, mean_burst_s=5.0)
    states = [p[2] for p in w.phases]
    assert states[0] == "calm" and all(x != y for x, y in itertools.pairwise(states))
    assert all(p[1] == q[0] for p, q in itertools.pairwise(w.phases))
    assert w.phases[0][0] == 0.0 and w.phases[-1][1] == 300.0
    times = _arrivals(w)
    in_burst = sum(int(((times >= a) & (times < b)).sum()) for a, b, s in w.phases if s == "burst")
    burst_time = sum(b - a for a, b, s in w.phases if s == "burst")
    assert in_burst / burst_time > 10 * (len(times) - in_burst) / (300.0 - burst_time)


# --- Mooncake --------------------------------------------------------------------------------


def test_mooncake_lengths_arrivals_and_shared_prefixes() -> None:
    w = mooncake(MOONCAKE, seed=1, labels=Labels(tenant="t", model="m", kind="completion"))
    assert [s.arrival_s for s in w.specs] == [0.0, 1.0, 2.5, 4.0]
    assert [s.prompt_tokens for s in w.specs] == [1100, 1536, 300, 2000]
    assert [s.max_tokens for s in w.specs] == [10, 20, 5, 7]
    texts = [s.prompt.text() for s in w.specs]
    toks = [tokenize(t) for t in texts]
    assert [len(t) for t in toks] == [1100, 1536, 300, 2000]
    assert toks[0][:1024] == toks[1][:1024] and toks[0][1024] != toks[1][1024]  # [0,1] shared, 2 != 3
    assert toks[1] == toks[3][:1536]  # [0,1,3] is a prefix of [0,1,3,5]
    assert toks[2][0] != toks[0][0]  # block 4 is not block 0
    assert w.specs[0].prefix_group == w.specs[1].prefix_group == "mooncake:0.1"
    assert w.duration_s == 4.0 and w.clipped == 0


def test_mooncake_rate_multiplier_duration_cap_and_limit() -> None:
    w = mooncake(MOONCAKE, rate_multiplier=2.0)
    assert [s.arrival_s for s in w.specs] == [0.0, 0.5, 1.25, 2.0]
    capped = mooncake(MOONCAKE, rate_multiplier=2.0, duration_s=1.5)
    assert [s.arrival_s for s in capped.specs] == [0.0, 0.5, 1.25] and capped.duration_s == 1.5
    limited = mooncake(MOONCAKE, limit=2)
    assert len(limited) == 2 and limited.duration_s == 1.0
    assert mooncake(MOONCAKE, duration_s=100).duration_s == 4.0  # the trace ends before the cap


def test_mooncake_token_scale_keeps_the_prefix_structure() -> None:
    w = mooncake(MOONCAKE, token_scale=0.25, block_tokens=512)
    # blocks of 128; last blocks scaled: 76 -> 19, 512 -> 128, 300 -> 75, 464 -> 116
    assert [s.prompt_tokens for s in w.specs] == [275, 384, 75, 500]
    assert [s.max_tokens for s in w.specs] == [2, 5, 1, 2]
    toks = [tokenize(s.prompt.text()) for s in w.specs]
    assert toks[0][:256] == toks[1][:256] and toks[0][256] != toks[1][256]
    assert toks[1] == toks[3][:384]


def test_mooncake_clips_to_max_model_len_and_counts() -> None:
    w = mooncake(MOONCAKE, max_model_len=1200, labels=Labels(kind="completion"))
    assert w.clipped == 2
    for s in w.specs:
        assert s.prompt_tokens + prompt_overhead_tokens("completion") + s.max_tokens <= 1200
        assert count_tokens(s.prompt.text()) == s.prompt_tokens
    # the cut keeps the shared prefix: request 1 and 3 still start alike
    assert tokenize(w.specs[1].prompt.text())[:1000] == tokenize(w.specs[3].prompt.text())[:1000]


def test_fit_lengths() -> None:
    overhead = prompt_overhead_tokens("chat")
    assert fit_lengths(100, 50, "chat", None) == (100, 50)
    assert fit_lengths(100, 50, "chat", 1000) == (100, 50)
    prompt, out = fit_lengths(5000, 50, "chat", 1000)
    assert (prompt, out) == (1000 - overhead - 50, 50)
    assert fit_lengths(10, 5000, "chat", 1000) == (1, 1000 - overhead - 1)
    with pytest.raises(WorkloadError):
        fit_lengths(10, 10, "chat", overhead + 1)


@pytest.mark.parametrize(("line", "message"), [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}', "does not fit"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "does not fit"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}', ">= 0"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "input_length >= 1"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]', "Mooncake row.*truncated"),
])
def test_mooncake_malformed_row_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    path.write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(WorkloadError, match=f"bad.jsonl:3: .*{message}"):
        mooncake(path)


# --- Azure -----------------------------------------------------------------------------------


def test_azure_parses_times_lengths_and_makes_unique_prompts() -> None:
    w = azure(AZURE, seed=3, labels=[(Labels(tenant="a"), 1.0), (Labels(tenant="b"), 1.0)])
    assert [s.arrival_s for s in w.specs] == pytest.approx([0.0, 0.052, 1.52004, 3.02004])
    assert [s.prompt_tokens for s in w.specs] == [480, 318, 100, 2000]
    assert [s.max_tokens for s in w.specs] == [10, 8, 20, 300]
    toks = [tokenize(s.prompt.text()) for s in w.specs]
    assert [len(t) for t in toks] == [480, 318, 100, 2000]
    assert len({tuple(t[:16]) for t in toks}) == 4  # no shared prefix between requests
    assert {s.tenant for s in w.specs} <= {"a", "b"}
    assert azure(AZURE, seed=3).specs[0].prompt.text() == w.specs[0].prompt.text()
    assert azure(AZURE, seed=4).specs[0].prompt.text() != w.specs[0].prompt.text()


def test_azure_scaling_cap_and_clip() -> None:
    w = azure(AZURE, rate_multiplier=2.0, duration_s=1.0, max_model_len=400, labels=Labels(kind="completion"))
    assert [s.arrival_s for s in w.specs] == pytest.approx([0.0, 0.026, 0.76002])
    assert w.clipped == 1 and w.specs[0].prompt_tokens == 400 - 1 - 10


@pytest.mark.parametrize(("row", "message"), [
    ("2023-11-16 18:17:03.1,abc,3", "invalid literal"),
    ("not a time,10,3", "Invalid isoformat"),
    ("2023-11-16 18:17:03.1,10", "too few fields"),
    ("2023-11-16 18:17:03.1,-1,3", ">= 0"),
])
def test_azure_malformed_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.0,10,3\n{row}\n")
    with pytest.raises(WorkloadError, match=f"bad.csv:3: .*{message}"):
        azure(path)


def test_azure_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "cols.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.0,10\n")
    with pytest.raises(WorkloadError, match=r"cols\.csv:1: missing column.*GeneratedTokens"):
        azure(path)


# --- merging -------------------------------------------------------------


def test_merge_interleaves_and_renumbers() -> None:
    a = mooncake(MOONCAKE, labels=Labels(tenant="a"))
    b = azure(AZURE, labels=Labels(tenant="b"))
    m = merge([a, b])
    assert len(m) == len(a) + len(b)
    assert [s.index for s in m.specs] == list(range(len(m)))
    assert list(_arrivals(m)) == sorted(_arrivals(m))
    assert m.duration_s == max(a.duration_s, b.duration_s)
