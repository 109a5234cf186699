"""The two targets of the conformance suite: a ``switchyard sim`` process and a real vLLM server.

``target`` runs every test once against the simulator (the default run) and once against real
vLLM (the ``vllm`` tier, ``pytest -m vllm``). ``sim`` is the simulator in both runs: against
vLLM a test also compares what it saw with what the simulator answers to the same request.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port
from tests.integration.conftest import stop, wait_http

SWITCHYARD = str(Path(sys.executable).with_name("switchyard"))
MODEL = "tiny-llama"
MAX_MODEL_LEN = 512


@dataclass(frozen=True)
class Target:
    """An engine under test.

    Attributes:
        name: "sim" or "vllm".
        url: Base URL (without ``/v1``).
    """

    name: str
    url: str
    model: str = MODEL
    max_model_len: int = MAX_MODEL_LEN
    #: Where its KV-cache events are published (a bound PUB socket) and replayed.
    kv_endpoint: str | None = None
    kv_replay: str | None = None

    @property
    def api(self) -> str:
        """The OpenAI API base URL."""
        return f"{self.url}/v1"

    @property
    def is_vllm(self) -> bool:
        """Whether this is the real engine (then tests compare it with the simulator)."""
        return self.name == "vllm"


@pytest.fixture(scope="session")
def sim_kv_events() -> Iterator[tuple[str, str]]:
    """The simulator's KV events endpoints: (PUB bound on an ipc path, replay on loopback)."""
    sockets = tempfile.mkdtemp(prefix="sy-sim-")  # short: ipc paths are limited to ~100 bytes
    try:
        yield f"ipc://{sockets}/sim", f"tcp://127.0.0.1:{free_port()}"
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture(scope="session")
def sim_url(tmp_path_factory: pytest.TempPathFactory, sim_kv_events: tuple[str, str]) -> Iterator[str]:
    """A ``switchyard sim`` process configured like the real servers of the vLLM tier."""
    port = free_port()
    log = tmp_path_factory.mktemp("conformance-sim") / "sim.log"
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sim_kv_events[0],
                         "replay_endpoint": sim_kv_events[1]})
    with log.open("wb") as out:
        proc = subprocess.Popen([SWITCHYARD, "sim", "--model", MODEL, "--port", str(port),
                                 "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                                 "--time-scale", "10", "--kv-events-config", events],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(f"{url}/health", proc)
        except RuntimeError as exc:
            pytest.fail(f"{exc}\n{log.read_text(errors='replace')}", pytrace=False)
        yield url
    finally:
        assert stop(proc), f"the simulator did not stop cleanly:\n{log.read_text(errors='replace')}"


@pytest.fixture
def sim(sim_url: str, sim_kv_events: tuple[str, str]) -> Target:
    """The simulator (the reference a real-vLLM run compares with)."""
    return Target("sim", sim_url, kv_endpoint=sim_kv_events[0], kv_replay=sim_kv_events[1])


@pytest.fixture(params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def target(request: pytest.FixtureRequest) -> Target:
    """The engine a test runs against: the simulator, or real vLLM (server ``a`` of the tier)."""
    if request.param == "sim":
        sim_target: Target = request.getfixturevalue("sim")
        return sim_target
    servers: Any = request.getfixturevalue("vllm_servers")
    servers.ensure_running()  # a failover test may have killed it
    events = servers.a.kv_events
    return Target("vllm", servers.a.url, kv_endpoint=events.endpoint, kv_replay=events.replay_endpoint)
