"""Switchyard: the control layer in front of vLLM.

Decides, for every request, which model handles it, whether it runs at all, where it runs and
what happens when it cannot — from one versioned policy document (``policies.yaml``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("switchyard")
except PackageNotFoundError:  # running from a bare checkout
    __version__ = "0.0.0"
