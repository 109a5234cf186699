"""`switchyard demo` starts gateway, console and engines in one command, and Ctrl-C stops them all."""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

from tests.helpers import free_port
from tests.integration.conftest import SWITCHYARD, http_json

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_stops_cleanly(tmp_path: Path) -> None:
    policy = (ROOT / "policies.yaml").read_text()
    ports = sorted(set(re.findall(r"http://127\.0\.0\.1:(\d+)", policy)))
    for old in ports:
        policy = policy.replace(f"127.0.0.1:{old}", f"127.0.0.1:{free_port()}")
    (tmp_path / "policies.yaml").write_text(policy)
    gateway_port = free_port()
    proc = subprocess.Popen([SWITCHYARD, "demo", "--port", str(gateway_port), "--time-scale", "20"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    output = ""
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
        deadline = time.monotonic() + 90
        while "Press Ctrl-C" not in output and time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(queue.Empty):
                output += lines.get(timeout=1)
        assert "Press Ctrl-C" in output, output
        key = re.search(r"(sk-sy-[A-Za-z0-9_-]+)", output)
        assert key, output
        base = f"http://127.0.0.1:{gateway_port}"
        for shown in (f"{base}/v1", f"{base}/admin/", "curl -s", "from openai import OpenAI", "policy v1)"):
            assert shown in output
        client = OpenAI(base_url=f"{base}/v1", api_key=key.group(1), max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "hi there"}], max_tokens=8)
        assert "model=small" in reply.headers["x-switchyard-route"]
        login = re.search(r"user (\S+), password (\S+) \(shown once\)", output)
        assert login, output
        console = httpx.Client(base_url=base)
        console.get("/admin/login")
        console.headers["x-csrftoken"] = console.cookies["switchyard_csrf"]
        answer = console.post("/admin/login", data={"username": login.group(1), "password": login.group(2)})
        assert answer.status_code == 303
        assert 'id="engines"' in console.get("/admin/").text
        assert (tmp_path / ".switchyard" / "switchyard.db").exists(), "embedded default: SQLite in the data dir"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        time.sleep(0.2)
        while not lines.empty():
            output += lines.get()
    assert proc.returncode == 0, output
    assert "stopped." in output
    for port in [gateway_port, *[int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", policy)]]:
        try:
            http_json("GET", f"http://127.0.0.1:{port}/health")
        except OSError:
            continue
        raise AssertionError(f"something still listens on {port} after the demo stopped")
