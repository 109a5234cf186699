"""The repository keeps its promises to a newcomer: README commands, CI, layout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", readme, flags=re.S)


def test_readme_starts_with_demo_then_test_command() -> None:
    demo, tests = _readme_commands()[:2]
    assert demo.endswith("switchyard demo")
    assert "pytest" in tests


def test_ci_runs_the_readme_test_command() -> None:
    tests = _readme_commands()[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), ".ci/run must call the README's test command verbatim"


def test_ci_checks_lint_and_types_before_the_tests() -> None:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    tests = lines.index(_readme_commands()[1])
    for check in (".venv/bin/ruff check platform tests", ".venv/bin/mypy"):
        assert check in lines[:tests], f".ci/run must run `{check}` before the tests"


def test_platform_is_a_source_root_not_a_package() -> None:
    assert not (ROOT / "platform" / "__init__.py").exists(), "it would shadow the stdlib module 'platform'"
    for package in ("policy", "decide", "gateway", "engines", "store", "admin", "sim", "bench", "whatif", "batch"):
        init = ROOT / "platform" / "switchyard" / package / "__init__.py"
        assert init.read_text().lstrip().startswith('"""'), f"{package} needs a docstring saying what it owns"


def _switchyard_imports(path: Path) -> set[str]:
    """The switchyard modules ``path`` imports, dotted: ``from switchyard.api import headers`` is
    ``switchyard.api.headers``, ``from switchyard.api.headers import X`` too."""
    text = path.read_text()
    found = set(re.findall(r"^\s*import (switchyard(?:\.\w+)+)", text, flags=re.M))
    for module, grouped, names in re.findall(r"^\s*from (switchyard(?:\.\w+)+) import (?:\(([^)]*)\)|(.*))", text,
                                             flags=re.M):
        folder = ROOT / "platform" / Path(*module.split("."))
        submodules = [name for name in re.findall(r"\w+", grouped or names)
                      if (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists()]
        found |= {f"{module}.{name}" for name in submodules} or {module}
    return found


def test_dependency_direction() -> None:
    """policy imports no other switchyard package; decide only policy; sim only itself; bench only
    itself and sim (it drives the gateway as a process, never from inside); whatif (the pre-publish
    replay) the decisions, the simulator, bench's workloads and the limit store, never the gateway; batch
    the gateway (its lines go through the gateway's request path), the store and the decisions. sim,
    bench and whatif may also use ``switchyard.figures``, a leaf that imports nothing of switchyard.

    ``switchyard.api`` (the HTTP surface's shared vocabulary: errors, OpenAPI pieces, header names) imports
    nothing of switchyard but itself; decide and bench may read its header names (``switchyard.api.headers``,
    a leaf) and nothing else of it. The gateway imports neither the console and admin API nor the Batch API
    (the composition root, ``switchyard.app``, assembles them), and those take errors and OpenAPI pieces from
    ``switchyard.api``, never from the gateway; the admin package is given narrow dependencies, never the
    gateway's runtime."""
    allowed = {"policy": {"policy"}, "decide": {"decide", "policy", "api"}, "state": {"state", "policy"},
               "sim": {"sim", "figures"}, "bench": {"bench", "sim", "figures", "api"},
               "whatif": {"whatif", "decide", "state", "policy", "sim", "bench", "store", "figures"},
               "batch": {"batch", "gateway", "store", "decide", "policy", "api"}, "api": {"api"}}
    for package, ok in allowed.items():
        for path in (ROOT / "platform" / "switchyard" / package).rglob("*.py"):
            for imported in re.findall(r"^\s*(?:from|import) switchyard\.(\w+)", path.read_text(), flags=re.M):
                assert imported in ok, f"{path.relative_to(ROOT)} imports switchyard.{imported}"
    package_of = {path: path.relative_to(ROOT / "platform" / "switchyard").parts[0]
                  for path in (ROOT / "platform" / "switchyard").rglob("*.py")}
    for path, package in package_of.items():
        where = path.relative_to(ROOT)
        imported = _switchyard_imports(path)
        if package in ("decide", "bench"):
            from_api = {m for m in imported if m == "switchyard.api" or m.startswith("switchyard.api.")}
            assert from_api <= {"switchyard.api.headers"}, f"{where} imports {sorted(from_api)}"
        if package == "gateway":
            assert not {m for m in imported if m.split(".")[1] in ("admin", "batch")}, f"{where} imports {imported}"
        if package in ("admin", "batch"):
            assert "switchyard.gateway.openapi_docs" not in imported, f"{where} reaches into the gateway's docs"
        if package == "admin":  # its handlers are given narrow dependencies (admin.dependencies)
            assert "switchyard.gateway.runtime" not in imported, f"{where} reaches for the gateway's runtime"
    headers = ROOT / "platform" / "switchyard" / "api" / "headers.py"
    assert _switchyard_imports(headers) == set(), "switchyard.api.headers is a leaf"


def test_python_m_switchyard_can_be_re_run_by_a_worker_process() -> None:
    """A gateway started as ``python -m switchyard serve`` (the demo does) hands the console's replay to an
    ``anyio.to_process`` worker, which re-runs the parent's main module as ``__mp_main__`` with no
    ``__main__`` in ``sys.modules``: the module must not start the command line then (it did, and click
    failed looking for ``__main__``)."""
    entry = ROOT / "platform" / "switchyard" / "__main__.py"
    script = ("import runpy, sys\n"
              "del sys.modules['__main__']\n"
              f"runpy.run_path({str(entry)!r}, run_name='__mp_main__')\n"
              "print('imported, not run')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "imported, not run"), done.stderr
