"""The report: complete, and the Markdown, the JSON and the plots agree."""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from switchyard.bench.report import (
    MISSING,
    TABLE_METRICS,
    build_report,
    interpreter_build,
    python_build,
    render_markdown,
    write_report,
)
from switchyard.bench.results import Result
from switchyard.bench.stats import Slo
from switchyard.bench.workload import RequestTemplate, bursty
from tests.unit.bench.helpers import result

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _arm(name: str, *, ttft: float, late: float, shed_every: int) -> list[Result]:
    out = []
    for i in range(60):
        cls = "critical" if i % 3 == 0 else "standard"
        status = 503 if i % shed_every == 0 else 200
        route = "model=m; fallback_from=big; pool=p2" if i % 7 == 0 else "model=m; pool=p1"
        out.append(result(i, arm=name, cls=cls, tenant=f"t{i % 2}", status=status, scheduled=i * 0.1, late=late,
                          ttft=ttft * (1 + i % 5), e2e=ttft * (1 + i % 5) + 0.4, itl=(0.01, 0.02), route=route,
                          prompt_tokens=100, cached_tokens=25))
    return out


@pytest.fixture
def report() -> dict[str, Any]:
    workload = bursty(1.0, 10.0, 6.0, [RequestTemplate()], seed=42, markov=False, mean_calm_s=2, mean_burst_s=1)
    arms = {"baseline": _arm("baseline", ttft=0.2, late=0.001, shed_every=5),
            "candidate": _arm("candidate", ttft=0.1, late=0.05, shed_every=10)}
    return build_report(arms, title="Test run", workload=workload, parameters={"scenario": "unit", "rate": 10},
                        seeds={"engines": 7}, slo={"critical": Slo(ttft_s=0.3), "*": Slo(ttft_s=0.5)},
                        groups=("class", "tenant"), notes=["a note"], not_landed=["prefix: no engines | yet"],
                        extra_series={"candidate": {"queue_depth": [1.0, 2.0, 3.0]}}, include_requests=True)


def _tables(md: str) -> dict[str, dict[str, list[str]]]:
    """Heading -> {row label -> cells} for every table in the Markdown; the header row is under ``metric``."""
    tables: dict[str, dict[str, list[str]]] = {}
    heading = ""
    for line in md.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("| ") and heading:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            tables.setdefault(heading, {})[cells[0]] = cells[1:]
    return tables


def _check_table(rows: dict[str, list[str]], arms: list[str], values: dict[str, Any], ratios: dict[str, Any]) -> None:
    assert rows["metric"][: len(arms)] == arms
    for key, label, mult, dec in TABLE_METRICS:
        cells = rows[label]
        for arm, cell in zip(arms, cells, strict=False):
            value = values[arm][key]
            if value is None:
                assert cell == MISSING
            else:
                assert float(cell) == pytest.approx(value * mult, abs=0.51 * 10**-dec), (label, arm)
        for arm, cell in zip(arms[1:], cells[len(arms):], strict=True):
            r = ratios[arm][key]
            assert cell == MISSING if r is None else float(cell.rstrip("x")) == pytest.approx(r, abs=0.006)


def test_files_are_written_and_agree(report: dict[str, Any], tmp_path: Path) -> None:
    files = write_report(report, tmp_path / "out")
    for role in ("markdown", "json", "ttft_cdf", "load", "shed"):
        assert files[role].exists() and files[role].stat().st_size > 0
    for name in ("ttft_cdf.png", "load_over_time.png", "shed_fallback.png"):
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    md = files["markdown"].read_text()
    data = json.loads(files["json"].read_text())
    assert data["plots"] == ["load_over_time.png", "shed_fallback.png", "ttft_cdf.png"]
    for plot in data["plots"]:
        assert f"]({plot})" in md
    arms = data["arms"]
    tables = _tables(md)
    _check_table(tables["Summary"], arms, data["overall"], data["ratios"])
    for key in ("class", "tenant"):
        for value, group in data["groups"][key].items():
            _check_table(tables[f"{key} = {value}"], arms, group["arms"], group["ratios"])
    assert set(data["groups"]["class"]) == {"critical", "standard"}
    assert set(data["groups"]["tenant"]) == {"t0", "t1"}


def test_content_is_complete(report: dict[str, Any]) -> None:
    md = render_markdown(report)
    assert report["arms"] == ["baseline", "candidate"] and report["baseline"] == "baseline"
    assert report["seeds"] == {"engines": 7, "workload": 42}
    assert report["workload"]["source"] == "bursty" and report["phases"]
    assert report["parameters"] == {"scenario": "unit", "rate": 10}
    assert report["machine"]["cpu_count"] and report["machine"]["python"]
    assert report["machine"]["packages"]["numpy"]
    assert len(report["requests"]["candidate"]) == 60
    assert report["slo"]["critical"]["ttft_s"] == 0.3
    for text in ("# Test run", "a note", r"prefix: no engines \| yet", "## Not landed", "scenario", "engines",
                 "version numpy", "cpu_count", "## By class", "## By tenant", "Per-request rows"):
        assert text in md, text
    # the candidate sent its requests 50 ms late: flagged; the baseline was on time
    assert report["generator_health"]["candidate"]["behind_schedule"]
    assert not report["generator_health"]["baseline"]["behind_schedule"]
    assert "**Behind schedule**" in md and "`candidate`" in md.split("**Behind schedule**")[1]


def test_series_and_cdf_are_consistent(report: dict[str, Any]) -> None:
    for arm in report["arms"]:
        ts = report["timeseries"][arm]
        n = len(ts["t_s"])
        assert all(len(ts[k]) == n for k in ("sent", "throughput_rps", "output_tps", "in_flight", "shed", "fallback"))
        assert sum(ts["sent"]) == report["overall"][arm]["count"]
        assert sum(ts["shed"]) == report["overall"][arm]["shed"]
        for cls, curve in report["ttft_cdf"][arm].items():
            ok_rate = report["groups"]["class"][cls]["arms"][arm]["ok_rate"]
            assert curve["y"] == sorted(curve["y"]) and curve["x_s"] == sorted(curve["x_s"])
            assert curve["y"][-1] == pytest.approx(ok_rate)  # failures never arrive
    assert report["timeseries"]["candidate"]["extra"] == {"queue_depth": [1.0, 2.0, 3.0]}
    assert report["timeseries"]["baseline"]["extra"] == {}


def test_ratios_are_candidate_over_baseline(report: dict[str, Any]) -> None:
    base, cand = report["overall"]["baseline"], report["overall"]["candidate"]
    assert report["ratios"]["candidate"]["ttft_p50_s"] == pytest.approx(cand["ttft_p50_s"] / base["ttft_p50_s"])
    assert "baseline" not in report["ratios"]


def test_single_arm_and_errors(tmp_path: Path) -> None:
    rep = build_report({"only": [result(0), result(1, status=503)]})
    files = write_report(rep, tmp_path)
    assert "only" in files["markdown"].read_text() and rep["ratios"] == {}
    empty = build_report({"none": []})
    write_report(empty, tmp_path / "empty")
    assert (tmp_path / "empty" / "ttft_cdf.png").stat().st_size > 0
    with pytest.raises(ValueError, match="at least one arm"):
        build_report({})
    with pytest.raises(ValueError, match="baseline"):
        build_report({"a": []}, baseline="b")


def test_the_machine_names_the_interpreters_build(report: dict[str, Any]) -> None:
    """The processes a run starts use this interpreter, and its build moves the figures: the report says which."""
    build = interpreter_build()
    assert Path(build["python_executable"]) == Path(os.path.realpath(sys.executable))
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    if "libpython" in maps:  # a shared libpython is named by the file this process maps
        assert build["libpython"] in maps and Path(build["libpython"]).name.startswith("libpython")
    else:
        assert build["libpython"] is None
    configured = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    assert build["python_configured"] == [o for o in ("--enable-optimizations", "--with-lto", "--enable-shared")
                                          if o in configured]
    assert {k: report["machine"][k] for k in build} == build
    text = python_build(build)
    assert text.startswith(build["python_executable"] + ", ")
    assert ("libpython shared" in text) == (build["libpython"] is not None)
    assert text.endswith(", ".join(build["python_configured"]) or "none")
    assert "python_executable" in render_markdown(report)
    bare = python_build({"python_executable": "/usr/bin/python3.11", "libpython": None, "python_configured": []})
    assert bare == ("/usr/bin/python3.11, no shared libpython; configure options among --enable-optimizations, "
                    "--with-lto, --enable-shared: none")
