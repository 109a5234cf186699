"""The two targets of the conformance suite: a ``switchyard sim`` process and a real vLLM server.

``target`` runs every test once against the simulator (the default run) and once against real
vLLM (the ``vllm`` tier, ``pytest -m vllm``). ``sim`` is the simulator in both runs: against
vLLM a test also compares what it saw with what the simulator answers to the same request.

The issue #32 features have targets of their own, built the same way: ``embed_target`` (vLLM: the
tiny Llama as the embedding model ``tiny-embed``; the sim: its ``tiny-llama`` engine, which answers
``/v1/embeddings`` too) and ``lora_target`` (``tiny-llama`` serving the adapter ``tiny-lora-a``,
runtime loading allowed; the sim: a second ``switchyard sim`` with the same LoRA flags). Their
vLLM servers are the tier's ``FeatureServers`` (``tests/realvllm.py``), shared with ``tests/vllm/``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import realvllm
from tests.helpers import free_port
from tests.integration.conftest import stop, wait_http
from tests.realvllm import FeatureServers

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
    #: LoRA adapters it serves from the start (name, directory), and the one to load at run time.
    adapters: tuple[tuple[str, str], ...] = ()
    runtime_adapter: tuple[str, str] | None = None

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


# --- the issue #32 features: embeddings and LoRA adapters ------------------------------------


@pytest.fixture(scope="session")
def vllm_feature_servers(vllm_env: Path, tiny_model: Path,
                         tmp_path_factory: pytest.TempPathFactory) -> Iterator[FeatureServers]:
    """The vLLM tier's LoRA and embedding servers (the same ones ``tests/vllm/`` uses)."""
    with realvllm.shared_feature_servers(vllm_env, tiny_model,
                                         lambda: tmp_path_factory.mktemp("vllm-feature-logs")) as servers:
        yield servers


@pytest.fixture(params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def embed_target(request: pytest.FixtureRequest) -> Target:
    """An engine serving ``/v1/embeddings``: the simulator (every engine of it answers embeddings), or
    real vLLM's embedding server."""
    if request.param == "sim":
        sim_target: Target = request.getfixturevalue("sim")
        return sim_target
    servers: FeatureServers = request.getfixturevalue("vllm_feature_servers")
    servers.ensure_running()
    return Target("vllm", servers.embed.url, model=realvllm.EMBED_MODEL)


@pytest.fixture(scope="session")
def lora_sim_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``switchyard sim`` configured like the vLLM tier's LoRA server (at twice real speed, not ten times:
    the metric test reads ``vllm:lora_requests_info`` while a 300-token request runs)."""
    adapters = realvllm.ensure_tiny_loras()
    port = free_port()
    log = tmp_path_factory.mktemp("conformance-lora-sim") / "sim.log"
    # vLLM's flags less --max-lora-rank (the sim takes no rank); runtime loading from the same variable.
    args = ["--enable-lora", "--max-loras", str(realvllm.MAX_LORAS), "--max-cpu-loras", str(realvllm.MAX_CPU_LORAS),
            "--lora-modules", f"{realvllm.LORA_STATIC}={adapters[realvllm.LORA_STATIC]}"]
    with log.open("wb") as out:
        proc = subprocess.Popen([SWITCHYARD, "sim", "--model", MODEL, "--port", str(port),
                                 "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                                 "--time-scale", "2", *args],
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **realvllm.RUNTIME_LORA_ENV})
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(f"{url}/health", proc)
        except RuntimeError as exc:
            pytest.fail(f"{exc}\n{log.read_text(errors='replace')}", pytrace=False)
        yield url
    finally:
        assert stop(proc), f"the simulator did not stop cleanly:\n{log.read_text(errors='replace')}"


def _lora_target(name: str, url: str, adapters: dict[str, Path]) -> Target:
    return Target(name, url, adapters=((realvllm.LORA_STATIC, str(adapters[realvllm.LORA_STATIC])),),
                  runtime_adapter=(realvllm.LORA_RUNTIME, str(adapters[realvllm.LORA_RUNTIME])))


@pytest.fixture
def lora_sim(lora_sim_url: str) -> Target:
    """The simulator with LoRA adapters (the reference a real-vLLM run compares with)."""
    return _lora_target("sim", lora_sim_url, realvllm.ensure_tiny_loras())


@pytest.fixture(params=["sim", pytest.param("vllm", marks=pytest.mark.vllm)])
def lora_target(request: pytest.FixtureRequest) -> Target:
    """``tiny-llama`` serving the adapter ``tiny-lora-a`` (``--max-loras 1 --max-cpu-loras 2``), runtime
    loading allowed: the simulator, or real vLLM's LoRA server."""
    if request.param == "sim":
        sim_target: Target = request.getfixturevalue("lora_sim")
        return sim_target
    servers: FeatureServers = request.getfixturevalue("vllm_feature_servers")
    servers.ensure_running()
    return _lora_target("vllm", servers.lora.url, servers.adapters)
