"""``switchyard bench`` without the bench extra says how to install it, before it starts anything."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Runs the command line in a fresh interpreter where ``missing`` cannot be imported (as if not installed).
_SCRIPT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # `import name` raises ImportError, as when it is not installed
from switchyard.cli import main
main(sys.argv[2:], prog_name="switchyard")
"""


def _run(missing: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _SCRIPT, missing, *args], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.parametrize("missing", ["matplotlib", "tqdm", "numpy,matplotlib,tqdm"])
def test_bench_without_the_extra_exits_naming_the_extra(missing: str) -> None:
    done = _run(missing, "bench", "--quick", "overhead")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pip install 'switchyard[bench]'" in done.stderr
    for name in missing.split(","):
        assert name in done.stderr
    assert "bench [" not in done.stderr, "the bench started before the check"


def test_bench_help_works_without_the_extra() -> None:
    done = _run("numpy,matplotlib,tqdm", "bench", "--help")
    assert done.returncode == 0, done.stderr
    assert "Measure Switchyard against baselines" in done.stdout
