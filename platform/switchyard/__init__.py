"""Switchyard: the control layer in front of vLLM.

Decides, for every request, which model handles it, whether it runs at all, where it runs and
what happens when it cannot — from one versioned policy document (``policies.yaml``).
"""

from __future__ import annotations

import functools


@functools.cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("switchyard")
    except PackageNotFoundError:  # running from a bare checkout
        return "0.0.0"


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed package's metadata when first asked for (``importlib.metadata``
    costs every command's start some 50 ms, and most never ask)."""
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
