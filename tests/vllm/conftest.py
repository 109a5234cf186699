"""Every test in this folder runs against real vLLM servers: it belongs to the ``vllm`` tier.

Besides the tier's two ``tiny-llama`` servers (``vllm_servers``, in ``tests/conftest.py``), the
servers of the issue #32 features, started together on first use and shared with the conformance
suite (``tests/realvllm.py``, ``FeatureServers``):

- ``vllm_lora_server``: ``tiny-llama`` plus the LoRA adapter ``tiny-lora-a`` (``--enable-lora
  --max-loras 1 --max-cpu-loras 2 --lora-modules tiny-lora-a=DIR``), with runtime loading
  (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): load ``tiny-lora-b`` from ``tiny_lora_adapters``
  with ``POST /v1/load_lora_adapter`` and unload it when done.
- ``vllm_embed_server``: ``tiny-embed``, serving ``/v1/embeddings`` (128 dimensions, Matryoshka).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import realvllm
from tests.realvllm import FeatureServers, VllmServer

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection sees the items
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests under ``tests/vllm/`` with ``vllm`` (the default run deselects them), and run the tests
    marked ``kills_a_server`` last: a server they kill is started again (some 30 s) only by a later test that
    needs it, so none does after the last of them."""
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)
    items.sort(key=lambda item: item.get_closest_marker("kills_a_server") is not None)


@pytest.fixture(scope="session")
def vllm_feature_servers(vllm_env: Path, tiny_model: Path,
                         tmp_path_factory: pytest.TempPathFactory) -> Iterator[FeatureServers]:
    """The LoRA server and the embedding server (both started in parallel, stopped at the end)."""
    with realvllm.shared_feature_servers(vllm_env, tiny_model,
                                         lambda: tmp_path_factory.mktemp("vllm-feature-logs")) as servers:
        yield servers


@pytest.fixture(scope="session")
def tiny_lora_adapters() -> dict[str, Path]:
    """The tiny model's LoRA adapters by name (``tiny-lora-a``, ``tiny-lora-b``): PEFT directories."""
    return realvllm.ensure_tiny_loras()


@pytest.fixture(scope="session")
def vllm_lora_server(vllm_feature_servers: FeatureServers) -> VllmServer:
    """``tiny-llama`` with ``tiny-lora-a`` loaded and runtime loading allowed (a test that kills it restarts
    it with ``vllm_feature_servers.ensure_running()``).

    Its ``/metrics`` has ``vllm:lora_requests_info``; ``realvllm.LORA_RUNTIME`` (``tiny-lora-b``) is
    the adapter to load at run time.
    """
    return vllm_feature_servers.lora


@pytest.fixture(scope="session")
def vllm_embed_server(vllm_feature_servers: FeatureServers) -> VllmServer:
    """``tiny-embed``: ``/v1/embeddings``, ``/tokenize``, ``/detokenize``."""
    return vllm_feature_servers.embed
