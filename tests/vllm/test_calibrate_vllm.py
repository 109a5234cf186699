"""`switchyard sim calibrate` against a real vLLM server on the CPU, and the comparison it makes.

The figures depend on the machine, so the checks are about completeness and consistency: every
number the profile and the report give is there and finite, the limits read from the engine are
the ones it was started with, and the simulator with the fitted profile lands within a loose
factor of the real server on the replayed workload.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from switchyard.sim.measured import load_profile_file
from tests.integration.test_sim import _free_port, _stop, _wait_healthy

SWITCHYARD = Path(sys.executable).with_name("switchyard")


def _table(report: str) -> dict[str, tuple[float, float]]:
    # Values under 0.01 ms are written as 5.00e-03 ms: on two cores the starved API server can send a
    # burst of tokens microseconds apart, so the real server's ITL p50 may be that small.
    number = r"([\d.,]+(?:e[+-]\d+)?)"
    rows = re.findall(rf"^\| (TTFT p\d\d|ITL p\d\d|mean TPOT) \| {number} ms \| {number} ms \| [+-][\d.]+% \|$",
                      report, flags=re.M)
    return {name: (float(real.replace(",", "")), float(sim.replace(",", ""))) for name, real, sim in rows}


#: How far the fitted simulator may land from the real server on the replay (a loose factor: the figures
#: depend on the machine).
BAND = (0.2, 5.0)


def _within_band(report_path: Path) -> bool:
    table = _table(report_path.read_text()) if report_path.exists() else {}
    return all(name in table and table[name][0] > 0 and BAND[0] < table[name][1] / table[name][0] < BAND[1]
               for name in ("TTFT p50", "mean TPOT"))


def _found_all_slots(profile_path: Path) -> bool:
    """Whether the calibration measured the server's 8 sequence slots (a starved run may see fewer)."""
    return profile_path.exists() and load_profile_file(profile_path).max_num_seqs == 8


def _enough_samples(profile_path: Path) -> bool:
    """Whether each group of the fit had at least three samples (a starved run may skip most decode batches as
    disturbed; a CI run once fitted a group on two)."""
    if not profile_path.exists():
        return False
    fit = load_profile_file(profile_path).provenance.get("fit", {})
    return all(fit.get(group, {}).get("samples", 0) >= 3 for group in ("prefill_ttft", "decode_itl"))


def test_calibrate_the_cpu_server_and_compare(vllm_servers: Any, tmp_path: Path) -> None:
    vllm_servers.ensure_running()
    server = vllm_servers.a
    out, report_path = tmp_path / "cpu-tiny.json", tmp_path / "report.md"
    command = [str(SWITCHYARD), "sim", "calibrate", "--url", server.url, "--out", str(out),
               "--report", str(report_path), "--quick"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    if result.returncode == 0 and not (_within_band(report_path) and _found_all_slots(out)
                                       and _enough_samples(out)):
        # On two shared cores the real server's API process is now and then starved for seconds (a CI run
        # once measured its replay TTFT p50 at 332 ms against 9.7 ms simulated, and 86 of 86 passed on the
        # rerun; another found 4 of the 8 sequence slots, twice in one probe, when the streams of a batch stalled
        # alike; another fitted a group on 2 samples, as when a starved run skips most decode batches as disturbed):
        # calibrate once more; two such runs in a row fail below.
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"{result.stderr}\n--- server log ---\n{server.log_tail()}"

    profile = load_profile_file(out)
    config = json.loads((server.model / "config.json").read_text())
    assert (profile.block_size, profile.max_model_len, profile.max_num_seqs) == (128, 512, 8)
    assert profile.vocab_size == config["vocab_size"]
    assert profile.kv_cache_tokens % 128 == 0 and profile.kv_cache_tokens >= 512
    for name, value in [*profile.step_time.as_dict().items(),
                        ("frontend_overhead_s", profile.frontend_overhead_s),
                        ("idle_wakeup_s", profile.idle_wakeup_s)]:
        assert math.isfinite(value) and 0 <= value < 1, name
    # Plausible for any machine: a first token within a second, a decode step under 0.2 s.
    first_token = profile.frontend_overhead_s + profile.step_seconds(16, 1, 16, 136)
    assert 0.0005 < first_token < 1.0
    assert 0.0001 < profile.step_seconds(1, 1, 100, 100) < 0.2

    prov = profile.provenance
    assert prov["served_model"] == "tiny-llama" and prov["engine_version"] == "0.32.0"
    assert prov["engine_url"] == server.url
    assert prov["sources"]["block_size"].startswith("/metrics")
    for group in ("prefill_ttft", "decode_itl"):
        quality = prov["fit"][group]
        assert quality["samples"] >= 3 and math.isfinite(quality["rms_residual_s"]), quality
    hits = prov["prefix_cache"]
    assert [h["cached_tokens"] for h in hits] == [128, 256, 384]  # whole blocks, read from /metrics

    report = report_path.read_text()
    for heading in ("## Engine limits", "## Fitted step-time model", "## Fit quality",
                    "### TTFT against prompt length", "### ITL against batch size",
                    "### Prefix-cache hits", "## Real engine against the simulator"):
        assert heading in report, heading
    table = _table(report)
    assert set(table) == {f"{m} p{q}" for m in ("TTFT", "ITL") for q in (50, 90, 99)} | {"mean TPOT"}
    assert all(math.isfinite(v) and v >= 0 for pair in table.values() for v in pair)
    for metric in ("TTFT", "ITL"):
        for side in (0, 1):
            values = [table[f"{metric} p{q}"][side] for q in (50, 90, 99)]
            assert values == sorted(values), (metric, side)
    for name in ("TTFT p50", "mean TPOT"):
        real, sim = table[name]
        assert real > 0 and BAND[0] < sim / real < BAND[1], (name, real, sim)
    assert prov["comparison"]["real"]["ttft_p50_s"] * 1000 == pytest.approx(table["TTFT p50"][0], rel=0.01)

    # The profile runs a simulator that stands in for the server.
    port = _free_port()
    proc = subprocess.Popen([str(SWITCHYARD), "sim", "--profile", str(out), "--model", "tiny-llama",
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base)
        card = httpx.get(f"{base}/v1/models").json()["data"][0]
        assert (card["id"], card["max_model_len"]) == ("tiny-llama", 512)
        body = {"model": "tiny-llama", "prompt": [profile.vocab_size - 1] * 8, "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=10).json()["usage"]["completion_tokens"] == 4
        body["prompt"] = [profile.vocab_size]
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=10).status_code == 400
    finally:
        assert _stop(proc) == 0
