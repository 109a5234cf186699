"""The repository keeps its promises to a newcomer: README commands, CI, layout."""

from __future__ import annotations

import ast
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
    packages = [p.name for p in (ROOT / "platform" / "switchyard").iterdir() if (p / "__init__.py").exists()]
    assert len(packages) >= 13
    for package in packages:
        init = ROOT / "platform" / "switchyard" / package / "__init__.py"
        assert init.read_text().lstrip().startswith('"""'), f"{package} needs a docstring saying what it owns"


#: Which parts of switchyard each part may import (every import, also those made inside a function): the
#: layering DESIGN.md draws, as the code has it. Parts are the packages and the top-level modules.
LAYERS: dict[str, set[str]] = {
    # Leaves.
    "policy": set(), "api": set(), "figures": set(), "logs": set(), "resources": set(), "settings": set(),
    # The simulated engines' tokenizer and chat template: the simulator serves with them, the gateway routes on them.
    "simtext": set(),
    # The decisions (pure; the request headers they read are api's names) and the state they read through views.
    "decide": {"policy", "api"}, "state": {"policy", "kvcache"}, "kvcache": set(),
    # What the gateway observes of its engines; the durable state.
    "engines": {"policy"}, "store": {"policy", "decide", "resources"},
    # The product's surfaces: the /v1 path, the Batch API (its lines go through the gateway's path), the console.
    "gateway": {"api", "decide", "state", "engines", "store", "policy", "figures", "logs", "settings", "simtext",
                "kvcache"},
    "batch": {"api", "gateway", "store", "decide", "policy"},
    "admin": {"api", "gateway", "decide", "engines", "state", "store", "policy", "whatif", "figures", "settings",
              "simtext"},
    # The composition root assembles the surfaces; the command line reaches everything (lazily).
    "app": {"gateway", "admin", "batch", "api", "settings", "resources"},
    "cli": {"app", "gateway", "admin", "batch", "decide", "state", "engines", "store", "policy", "whatif", "sim",
            "kvcache", "bench", "api", "figures", "logs", "resources", "settings"},
    "__main__": {"cli"},
    # The pre-publish replay: the procedure on the simulator, with bench's workloads and the limit store.
    "whatif": {"decide", "state", "policy", "sim", "simtext", "bench", "store", "figures"},
    # Tooling: the simulator imports only itself; the bench drives everything as processes, never from inside.
    "sim": {"figures", "simtext", "kvcache"}, "bench": {"sim", "simtext", "figures", "api"},
}
PLATFORM = ROOT / "platform" / "switchyard"


def _switchyard_imports(path: Path) -> set[str]:
    """The switchyard modules ``path`` imports, dotted, wherever the import statement is: ``from switchyard.api
    import headers`` and ``from switchyard.api.headers import X`` are both ``switchyard.api.headers``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("switchyard.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("switchyard."):
            module = node.module or ""
            folder = ROOT / "platform" / Path(*module.split("."))
            submodules = {f"{module}.{a.name}" for a in node.names
                          if (folder / f"{a.name}.py").exists() or (folder / a.name / "__init__.py").exists()}
            found |= submodules or {module}
    return found


def _part(path: Path) -> str:
    return path.relative_to(PLATFORM).parts[0].removesuffix(".py")


def test_every_part_imports_only_what_its_layer_allows() -> None:
    """Dependencies point one way (DESIGN.md): policy imports no other part of switchyard; decide only policy
    (and the request headers' names in ``api.headers``); state and engines only policy; the gateway neither the
    console and admin API nor the Batch API (``switchyard.app`` assembles them); sim only itself (and the
    ``figures`` leaf); bench never the product from inside; whatif never the gateway."""
    parts = {_part(path) for path in PLATFORM.rglob("*.py")} - {"__init__"}
    assert parts == set(LAYERS), f"parts without a layer, or layers without a part: {sorted(parts ^ set(LAYERS))}"
    for path in PLATFORM.rglob("*.py"):
        part = _part(path)
        if part == "__init__":
            continue
        for module in _switchyard_imports(path):
            target = module.split(".")[1]
            assert target == part or target in LAYERS[part], f"{path.relative_to(ROOT)} imports {module}"


def test_finer_rules_of_the_layers() -> None:
    """decide and bench read only the header names of ``api`` (a leaf); the console and the Batch API take
    errors and OpenAPI pieces from ``switchyard.api``, never from the gateway; the console's handlers are given
    narrow dependencies, never the gateway's runtime."""
    for path in PLATFORM.rglob("*.py"):
        part, where, imported = _part(path), path.relative_to(ROOT), _switchyard_imports(path)
        if part in ("decide", "bench"):
            from_api = {m for m in imported if m == "switchyard.api" or m.startswith("switchyard.api.")}
            assert from_api <= {"switchyard.api.headers"}, f"{where} imports {sorted(from_api)}"
        if part in ("admin", "batch"):
            assert "switchyard.gateway.openapi_docs" not in imported, f"{where} reaches into the gateway's docs"
        if part == "admin":
            assert "switchyard.gateway.runtime" not in imported, f"{where} reaches for the gateway's runtime"
    assert _switchyard_imports(PLATFORM / "api" / "headers.py") == set(), "switchyard.api.headers is a leaf"


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
