"""`switchyard demo` starts gateway, console and engines in one command, and Ctrl-C stops them all."""

from __future__ import annotations

import contextlib
import queue
import random
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from switchyard.cli.demo_cmd import SIM_POLICY_HEADER
from tests.helpers import free_port
from tests.integration.conftest import SWITCHYARD, http_json

ROOT = Path(__file__).resolve().parents[2]


class Demo:
    """One ``switchyard demo`` process in ``folder``, its output read as it comes."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.proc = subprocess.Popen([SWITCHYARD, "demo", "--time-scale", "20", *args], cwd=folder,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output = ""
        self._lines: queue.Queue[str] = queue.Queue()
        stdout = self.proc.stdout
        assert stdout is not None
        threading.Thread(target=lambda: [self._lines.put(line) for line in stdout], daemon=True).start()

    def ready(self, timeout_s: float = 90) -> Demo:
        deadline = time.monotonic() + timeout_s
        while "Press Ctrl-C" not in self.output and time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(queue.Empty):
                self.output += self._lines.get(timeout=1)
        assert "Press Ctrl-C" in self.output, self.output
        return self

    def ended(self, timeout_s: float = 60) -> int:
        code = self.proc.wait(timeout=timeout_s)
        time.sleep(0.2)
        while not self._lines.empty():
            self.output += self._lines.get()
        return code

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.ended(30)

    @property
    def base(self) -> str:
        found = re.search(r"API \(OpenAI-compatible\)\s+(http://\S+)/v1", self.output)
        assert found, self.output
        return found.group(1)

    @property
    def key(self) -> str:
        found = re.search(r"(sk-sy-[A-Za-z0-9_-]+)", self.output)
        assert found, self.output
        return found.group(1)

    def ask(self) -> str:
        client = OpenAI(base_url=f"{self.base}/v1", api_key=self.key, max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "hi there"}], max_tokens=8)
        return reply.headers["x-switchyard-route"]

    def console(self) -> httpx.Client:
        login = re.search(r"user (\S+), password (\S+) \(shown once\)", self.output)
        assert login, self.output
        console = httpx.Client(base_url=self.base)
        console.get("/admin/login")
        console.headers["x-csrftoken"] = console.cookies["switchyard_csrf"]
        answer = console.post("/admin/login", data={"username": login.group(1), "password": login.group(2)})
        assert answer.status_code == 303
        return console


@contextlib.contextmanager
def running(folder: Path, *args: str) -> Iterator[Demo]:
    demo = Demo(folder, *args)
    try:
        yield demo.ready()
    finally:
        assert demo.stop() == 0, demo.output
        assert "stopped." in demo.output


def _engine_port(taken: set[int]) -> int:
    """A port for a simulated engine of the demo policy, free with its KV-event ports (+1000, +2000): below the
    kernel's ephemeral range (32768 up), where no outgoing connection of another process (or test) can take
    one of them between this check and the engine's bind, as a port picked by the kernel can be."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 29000)
        trio = {port, port + 1000, port + 2000}
        if trio & taken or not all(_port_free(p) for p in trio):
            continue
        taken.update(trio)
        return port
    raise AssertionError("no free engine port below the ephemeral range")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def test_demo_runs_and_stops_cleanly(tmp_path: Path) -> None:
    policy = (ROOT / "policies.yaml").read_text()
    ports = sorted(set(re.findall(r"http://127\.0\.0\.1:(\d+)", policy)))
    taken: set[int] = set()
    for old in ports:
        policy = policy.replace(f"127.0.0.1:{old}", f"127.0.0.1:{_engine_port(taken)}")
    (tmp_path / "policies.yaml").write_text(policy)
    gateway_port = free_port()
    with running(tmp_path, "--port", str(gateway_port)) as demo:
        base = f"http://127.0.0.1:{gateway_port}"
        assert demo.base == base
        for shown in (f"{base}/v1", f"{base}/admin/", "curl -s", "from openai import OpenAI", "policy v1)"):
            assert shown in demo.output
        assert "model=small" in demo.ask()
        console = demo.console()
        assert 'id="engines"' in console.get("/admin/").text
        # The policy is in the database by default, so the console can edit, publish and roll back.
        page = console.get("/admin/policy").text
        assert 'id="file-mode-banner"' not in page and "Edit the YAML" in page
        audit = console.get("/admin/audit").text  # the demo's own tenant and key are on record
        assert "tenant.create" in audit and "key.create" in audit
        assert (tmp_path / ".switchyard" / "switchyard.db").exists(), "embedded default: SQLite in the data dir"
    for port in [gateway_port, *[int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", policy)]]:
        try:
            http_json("GET", f"http://127.0.0.1:{port}/health")
        except OSError:
            continue
        raise AssertionError(f"something still listens on {port} after the demo stopped")


@pytest.mark.alone  # it starts the demo on its usual ports, and a second one beside it
def test_a_demo_restarts_at_once_and_a_second_one_takes_free_ports(tmp_path: Path) -> None:
    first, second, third = (tmp_path / name for name in ("first", "second", "third"))
    for folder in (first, second, third):
        folder.mkdir()
    with running(first) as demo:
        seed = first / ".switchyard" / "policies.yaml"
        assert "model=small" in demo.ask()  # connections the gateway and the engines then close (TIME_WAIT)
        usual = demo.base
    # An operator's edit of the demo's copy of the policy survives a restart (copied only when there is none).
    seed.write_text(seed.read_text() + "\n# kept by the operator\n")
    with running(first) as demo:  # at once: ports in TIME_WAIT are not "in use"
        assert demo.base == usual and "ports already in use" not in demo.output
        assert "model=small" in demo.ask()
        assert seed.read_text().endswith("# kept by the operator\n")
        with running(second) as other:  # the usual ports are taken: this one moves
            assert other.base != usual and "the usual ports are taken" in other.output
            assert "model=small" in other.ask() and "model=small" in demo.ask()
            engines = (second / ".switchyard" / "demo-engines.yaml").read_text()
            assert engines.startswith(SIM_POLICY_HEADER) and "127.0.0.1:8401" not in engines
            versions = other.console().get("/admin/policy").text
            assert "the demo&#39;s engines moved by" in versions or "the demo's engines moved by" in versions
        # In file mode the file is not rewritten: busy ports are an error that says what to do.
        refused = Demo(third, "--policy-source", "file")
        assert refused.ended() != 0
        assert "ports already in use" in refused.output and "--policy-source db" in refused.output
