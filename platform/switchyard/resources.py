"""Where the shipped non-Python files are: templates, static files, migrations, demo policy.

An installed wheel carries them inside the package (``switchyard/ui``, ``switchyard/migrations``,
``switchyard/policies.yaml``); a source checkout keeps them at the repository's top level.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def _find(name: str) -> Path:
    packaged = Path(str(files("switchyard"))) / name
    if packaged.exists():
        return packaged
    checkout = Path(__file__).resolve().parents[2] / name
    if checkout.exists():
        return checkout
    raise FileNotFoundError(f"switchyard is missing its {name!r} files (looked in {packaged} and {checkout})")


def templates_dir() -> Path:
    """Jinja2 templates of the admin console."""
    return _find("ui") / "templates"


def static_dir() -> Path:
    """Static files of the admin console (vendored htmx, css)."""
    return _find("ui") / "static"


def migrations_dir() -> Path:
    """Alembic's script directory."""
    return _find("migrations")


def demo_policy() -> Path:
    """The demo ``policies.yaml`` shipped with the package."""
    return _find("policies.yaml")
