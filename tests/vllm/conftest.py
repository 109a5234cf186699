"""Every test in this folder runs against real vLLM servers: it belongs to the ``vllm`` tier."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection sees the items
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests under ``tests/vllm/`` with ``vllm`` (the default run deselects them)."""
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.vllm)
