"""The schema head a database is checked against without Alembic is Alembic's own head."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from switchyard.store import db


def test_the_recorded_head_is_the_newest_migration() -> None:
    # A new migration needs its revision in ``SCHEMA_HEAD`` too, or no command would take an upgraded database.
    assert db.head_revision() == db.SCHEMA_HEAD


def test_checking_a_database_imports_no_alembic(tmp_path: Path) -> None:
    # (A fresh interpreter: this one has Alembic loaded already.)
    code = ("import sys; from switchyard.store import db; import switchyard.app; "
            f"e = db.create_db_engine('sqlite:///{tmp_path}/x.db'); assert not db.is_current(e); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('alembic', 'mako')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]", done.stdout
