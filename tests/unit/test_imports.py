"""The product does not import the tooling, and the command line starts without the server.

Each check runs a fresh interpreter and reads its ``sys.modules`` afterwards: importing the gateway app
must not load the simulator, the bench, the what-if replay or the bench's libraries (numpy, matplotlib,
tqdm), and ``switchyard --help`` (or ``switchyard <command> --help``) must not load the web framework,
the database layer, the HTTP client or the gateway. Only what is loaded is asserted, never how long it
takes: README.md ("Start-up time") has the measured figures.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from switchyard.cli import COMMANDS

#: What the gateway must not import: the tooling and the bench extra's libraries.
TOOLING = ("switchyard.sim", "switchyard.bench", "switchyard.whatif", "numpy", "matplotlib", "tqdm")
#: What printing the command line's help must not import.
SERVER = ("litestar", "sqlalchemy", "sqlmodel", "aiohttp", "uvicorn", "pydantic", "switchyard.gateway",
          "switchyard.store.db", "switchyard.policy", "switchyard.decide", *TOOLING)
#: What a process loads only when its settings or a request ask for it: the Redis client (``redis_url``),
#: PostgreSQL's driver (a ``postgresql://`` database), the OpenID Connect client (a console sign-in through the
#: identity provider) and AES-GCM (a sealed cookie); about a quarter of the gateway's import time.
ON_DEMAND = ("redis", "psycopg", "httpx", "jwt", "cryptography", "opentelemetry")
#: The bench extra's libraries (``pip install 'switchyard[bench]'``).
BENCH_EXTRA = ("matplotlib", "tqdm")


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (whatever it printed before)."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def _among(loaded: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == n or m.startswith(f"{n}.") for n in names))


def test_importing_the_gateway_loads_no_tooling() -> None:
    """The composition root (``switchyard.app``: gateway, console, admin and Batch APIs) loads no tooling."""
    loaded = _loaded_after("import switchyard.app")
    assert "switchyard.app" in loaded and "switchyard.gateway.proxy" in loaded
    assert _among(loaded, TOOLING) == []


def test_importing_the_gateway_or_the_store_loads_no_backend_it_may_not_use() -> None:
    """Redis, PostgreSQL's driver, the OpenID Connect client and AES-GCM are loaded where they are first used, not
    by the imports of the gateway, the console or the key and tenant commands' store."""
    loaded = _loaded_after("import switchyard.app, switchyard.store.keys, switchyard.store.tenants\n"
                           "from switchyard.store.limits import create_limit_store\n"
                           "from switchyard.store.cache import create_response_cache\n"
                           "create_limit_store(None), create_response_cache(None)")
    assert _among(loaded, ON_DEMAND) == []
    # ... and each is there when asked for by name (the packages' lazy attributes).
    loaded = _loaded_after("from switchyard.store.limits import RedisLimitStore\n"
                           "from switchyard.store.cache import RedisResponseCache\n"
                           "import switchyard\nassert switchyard.__version__")
    assert "redis" in loaded and "importlib.metadata" in loaded


@pytest.mark.parametrize("args", [[], *([name] for name in sorted(COMMANDS))], ids=lambda a: " ".join(["--help", *a]))
def test_help_loads_no_server(args: list[str]) -> None:
    code = ("from switchyard.cli import main\n"
            "try:\n"
            f"    main({[*args, '--help']!r}, prog_name='switchyard')\n"
            "except SystemExit as done:\n"
            "    assert done.code == 0, done.code\n")
    loaded = _loaded_after(code)
    assert _among(loaded, SERVER) == []


def test_the_product_needs_no_bench_extra() -> None:
    """What the demo runs (its own process, ``switchyard sim`` and ``switchyard serve``), the gateway and the
    console's pre-publish replay (its worker imports ``switchyard.whatif``) import no matplotlib and no tqdm;
    none but the replay imports numpy."""
    demo = ["switchyard.cli.demo_cmd", "switchyard.decide.policy_tests", "switchyard.store.db", "switchyard.store.keys",
            "switchyard.store.tenants", "switchyard.store.admin_users"]
    serving = [*demo, "switchyard.cli.run_cmds", "switchyard.sim", "switchyard.sim.serve", "switchyard.gateway.server",
               "switchyard.app"]
    loaded = _loaded_after("\n".join(f"import {name}" for name in serving))
    assert _among(loaded, ("numpy", *BENCH_EXTRA)) == []
    assert _among(_loaded_after("import switchyard.whatif, switchyard.whatif.logged"), BENCH_EXTRA) == []
