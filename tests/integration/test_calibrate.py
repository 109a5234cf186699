"""`switchyard sim calibrate` against a known engine: a `switchyard sim` process.

The simulator with a built-in profile is an engine whose costs are known exactly, so
calibrating it checks the method end to end: the fitted coefficients must recover the
profile's own (divided by the time scale, since the client measures wall-clock time), and the
profile written must load into a new simulator.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from switchyard.sim.measured import load_profile_file
from switchyard.sim.profiles import PROFILES
from tests.integration.test_sim import _free_port, _stop, _wait_healthy

# Timings compared with what they should be: no other test competes for the cores meanwhile.
pytestmark = pytest.mark.alone

SWITCHYARD = Path(sys.executable).with_name("switchyard")
MODEL = "sim-calibrated"
#: Simulated seconds per wall-clock second of the engine under calibration.
TIME_SCALE = 0.5


def _sim(port: int, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(SWITCHYARD), "sim", "--model", MODEL, "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    """Calibrate an h100-8b simulator once: (profile file, report file, command output)."""
    out = tmp_path_factory.mktemp("calibrate")
    port = _free_port()
    proc = _sim(port, "--time-scale", str(TIME_SCALE))
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}")
        result = subprocess.run(
            [str(SWITCHYARD), "sim", "calibrate", "--url", f"http://127.0.0.1:{port}", "--out",
             str(out / "sim.json"), "--report", str(out / "report.md"), "--quick",
             "--replay-requests", "24"],
            capture_output=True, text=True, timeout=240, check=False)
        assert result.returncode == 0, result.stderr
        yield out / "sim.json", out / "report.md", result.stdout + result.stderr
    finally:
        assert _stop(proc) == 0


def test_calibration_recovers_the_simulators_own_coefficients(calibrated: tuple[Path, Path, str]) -> None:
    profile = load_profile_file(calibrated[0])
    true = PROFILES["h100-8b"].step_time
    fit = profile.step_time
    s = TIME_SCALE
    # The combinations the measurements pin down well.
    assert fit.per_token_s == pytest.approx(true.per_token_s / s, rel=0.25)
    assert fit.step_s + fit.weights_s == pytest.approx((true.step_s + true.weights_s) / s, rel=0.15)
    # The client also sees real HTTP and event-loop time, which the sim does not scale.
    frontend = profile.frontend_overhead_s + profile.idle_wakeup_s
    assert 0.006 / s - 0.001 < frontend < 0.006 / s + 0.006
    # And what the profile predicts, over the range measured (least sharply around the knee
    # where prefill turns from bandwidth- to compute-bound, near 220 tokens on an H100).
    for n in (16, 128, 512, 2048):
        pairs = n * (n + 1) // 2
        assert fit.seconds(n, 1, n, pairs) == pytest.approx(true.seconds(n, 1, n, pairs) / s,
                                                            rel=0.25), n
    for batch, kv in ((1, 50), (8, 4000), (16, 800)):
        assert fit.seconds(batch, batch, kv, kv) == pytest.approx(
            true.seconds(batch, batch, kv, kv) / s, rel=0.1), (batch, kv)
    # Facts read from the engine.
    built_in = PROFILES["h100-8b"]
    assert (profile.block_size, profile.kv_cache_tokens, profile.max_model_len, profile.vocab_size) == (
        16, built_in.kv_cache_tokens, built_in.max_model_len, built_in.vocab_size)
    # 1024 sequences are never reached by a quick calibration: a lower bound, and it says so.
    assert profile.max_num_seqs == 16
    assert "lower bound" in profile.provenance["sources"]["max_num_seqs"]


def test_profile_says_where_its_numbers_come_from(calibrated: tuple[Path, Path, str]) -> None:
    doc = json.loads(calibrated[0].read_text())
    prov = doc["provenance"]
    assert prov["served_model"] == MODEL and prov["engine_url"].startswith("http://127.0.0.1:")
    assert re.match(r"\d{4}-\d\d-\d\dT", prov["date"])
    for key in ("step_time", *doc["step_time"], "frontend_overhead_s", "idle_wakeup_s", "block_size",
                "kv_cache_tokens", "max_model_len", "max_num_seqs", "vocab_size"):
        assert prov["sources"].get(key), key
    for group in ("prefill_ttft", "decode_itl"):
        quality = prov["fit"][group]
        assert quality["samples"] >= 5 and quality["max_relative_error"] < 0.2, quality
    assert len(prov["prefix_cache"]) == 3 and all(h["speedup"] > 1 for h in prov["prefix_cache"])
    comparison = prov["comparison"]
    assert set(comparison["real"]) == set(comparison["sim"]) == {
        f"{m}_p{q}_s" for m in ("ttft", "itl") for q in (50, 90, 99)}


def _table(report: str) -> dict[str, tuple[float, float]]:
    rows = re.findall(r"^\| (TTFT p\d\d|ITL p\d\d|mean TPOT) \| ([\d.,]+) ms \| ([\d.,]+) ms \| [+-][\d.]+% \|$",
                      report, flags=re.M)
    return {name: (float(real.replace(",", "")), float(sim.replace(",", ""))) for name, real, sim in rows}


def test_report_compares_the_engine_with_the_fitted_simulator(calibrated: tuple[Path, Path, str]) -> None:
    report = calibrated[1].read_text()
    assert report in calibrated[2]  # also printed
    table = _table(report)
    assert set(table) == {f"{m} p{q}" for m in ("TTFT", "ITL") for q in (50, 90, 99)} | {"mean TPOT"}
    assert all(math.isfinite(v) and v >= 0 for pair in table.values() for v in pair)
    for metric in ("TTFT", "ITL"):
        reals = [table[f"{metric} p{q}"][0] for q in (50, 90, 99)]
        assert reals == sorted(reals)
    # A simulator with the fitted profile is a close copy of the one it was fitted to.
    for name in ("TTFT p50", "mean TPOT"):
        real, sim = table[name]
        assert sim == pytest.approx(real, rel=0.35), name


def test_the_written_profile_runs_a_simulator(calibrated: tuple[Path, Path, str], tmp_path: Path) -> None:
    port = _free_port()
    proc = _sim(port, "--profile", str(calibrated[0]))
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base)
        state = httpx.get(f"{base}/sim/state").json()
        assert state["profile"] == "sim" and state["max_num_seqs"] == 16
        body = {"model": MODEL, "prompt": [1000, 2000, 3000], "max_tokens": 3, "ignore_eos": True}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=10).json()
        assert reply["usage"]["completion_tokens"] == 3
    finally:
        assert _stop(proc) == 0


def test_calibrating_nothing_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(SWITCHYARD), "sim", "calibrate", "--url", f"http://127.0.0.1:{_free_port()}", "--out",
         str(tmp_path / "p.json")], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1
    assert "Error: cannot reach http://127.0.0.1:" in result.stderr
    assert not (tmp_path / "p.json").exists()


def test_a_bad_profile_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "switchyard.sim.profile/1"}')
    result = subprocess.run([str(SWITCHYARD), "sim", "--model", "m", "--port", str(_free_port()),
                             "--profile", str(bad)], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == f"sim: profile {bad}: Object missing required field `name`"
