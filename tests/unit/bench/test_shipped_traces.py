"""The public traces the benchmarks replay ship with the package, so that an installed copy runs its scenarios
from any folder (it used to look for ``../shared/data/traces`` relative to the working folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard.bench.scenarios.cache.workload import public_repeats
from switchyard.bench.scenarios.prefix import default_trace
from switchyard.bench.traces import mooncake


def test_the_default_trace_is_found_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    trace = default_trace()
    assert trace.is_file() and trace.name == "mooncake_conversation.jsonl"
    assert "switchyard" in trace.parts and "bench" in trace.parts and "shared" not in trace.parts
    workload = mooncake(trace, duration_s=5.0)
    assert len(workload.specs) > 0
    # The cache scenario's note on the public traces' repeats finds both shipped Mooncake traces.
    found = public_repeats(None)
    assert [phrase.split(":")[0] for phrase in found] == ["mooncake_conversation.jsonl", "mooncake_synthetic.jsonl"]
    assert "12,031 rows" in found[0]


def test_the_shipped_traces_keep_their_attribution_and_licence() -> None:
    notes = (default_trace().parent / "README.md").read_text()
    assert "Mooncake" in notes and "FAST 2025" in notes and "Apache" in notes
