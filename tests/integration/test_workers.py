"""`switchyard serve --workers N`: N processes on one port sharing PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.helpers import free_port
from tests.integration.conftest import GATEWAY_SETTINGS, SWITCHYARD, Engines, Gateway, stop, wait_http

REDIS = "redis://127.0.0.1:6379/0"
LIMIT = 12  # requests per minute for the tenant, across both processes


@pytest.fixture(scope="module")
def workers(engines: Engines, tmp_path_factory: pytest.TempPathFactory,
            pg_database: Callable[[], str]) -> Iterator[Gateway]:
    data_dir = tmp_path_factory.mktemp("gw-workers")
    port = free_port()
    env = {**os.environ, **GATEWAY_SETTINGS, "SWITCHYARD_DATA_DIR": str(data_dir),
           "SWITCHYARD_DATABASE_URL": pg_database(), "SWITCHYARD_POLICY_FILE": str(engines.policy_file),
           "SWITCHYARD_REDIS_URL": REDIS, "SWITCHYARD_REDIS_KEY_PREFIX": f"workers-{uuid.uuid4().hex[:8]}:"}
    proc = subprocess.Popen([SWITCHYARD, "serve", "--workers", "2", "--port", str(port)], env=env)
    gateway = Gateway(f"http://127.0.0.1:{port}", env, "postgresql", proc)
    try:
        wait_http(f"{gateway.base_url}/readyz", proc)
        gateway.keys = {"pro": gateway.new_key("workers-co", "pro")}
        gateway.cli("tenants", "set-limits", "workers-co", f'{{"requests_per_minute": {LIMIT}}}')
        yield gateway
    finally:
        assert stop(proc, timeout=30)


async def burst(gw: Gateway, count: int) -> list[tuple[int, str]]:
    """``count`` requests at once, each on a connection of its own: (status, x-request-id) each."""

    async def one() -> tuple[int, str]:
        api = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=gw.keys["pro"], max_retries=0, timeout=30)
        try:
            raw = await api.chat.completions.with_raw_response.create(
                model="small", messages=[{"role": "user", "content": "count me"}], max_tokens=3)
            return raw.status_code, raw.headers["x-request-id"]
        except openai.APIStatusError as err:
            return err.status_code, err.response.headers.get("x-request-id", "")
        finally:
            await api.close()

    return list(await asyncio.gather(*(one() for _ in range(count))))


def test_two_processes_serve_and_share_one_limit_exactly(workers: Gateway) -> None:
    children = _children(workers.proc.pid)
    assert len(children) >= 2, f"uvicorn's supervisor has {len(children)} worker processes"
    started = time.monotonic()
    answers = asyncio.run(burst(workers, 3 * LIMIT))
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200] * LIMIT + [429] * (2 * LIMIT), statuses
    # Which process answered: the request id's first 12 characters are per process. The kernel hands
    # new connections to whichever worker accepts first, so more bursts may be needed to see both;
    # with one bucket per process, the second would admit its own LIMIT. The bucket refills at
    # LIMIT a minute meanwhile.
    seen = {rid[:12] for _, rid in answers}
    admitted_later = 0
    for _ in range(30):
        if len(seen) == 2:
            break
        more = asyncio.run(burst(workers, 8))
        admitted_later += sum(status == 200 for status, _ in more)
        assert {status for status, _ in more} <= {200, 429}
        seen |= {rid[:12] for _, rid in more}
    assert len(seen) == 2, f"one process answered every request: {seen}"
    assert admitted_later <= 1 + (time.monotonic() - started) * LIMIT / 60, admitted_later


def test_workers_without_redis_is_refused_with_the_reason(engines: Engines, tmp_path: Path) -> None:
    env = {**os.environ, **GATEWAY_SETTINGS, "SWITCHYARD_DATA_DIR": str(tmp_path),
           "SWITCHYARD_POLICY_FILE": str(engines.policy_file)}
    env.pop("SWITCHYARD_REDIS_URL", None)
    result = subprocess.run([SWITCHYARD, "serve", "--workers", "3", "--port", str(free_port())], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--workers 3 needs SWITCHYARD_REDIS_URL" in result.stderr


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` running switchyard's gateway (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == pid and b"multiprocessing" in cmdline:
            out.append(int(entry.name))
    return out
