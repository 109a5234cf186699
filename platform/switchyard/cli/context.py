"""What every subcommand shares: settings built from the environment plus global options."""

from __future__ import annotations

import getpass
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from switchyard.settings import Settings


@dataclass(frozen=True)
class CliContext:
    """Global options given before the subcommand."""

    data_dir: Path | None = None
    database_url: str | None = None
    policy_file: Path | None = None

    def settings(self, **overrides: Any) -> Settings:
        """Settings from the environment, the global options and ``overrides`` (last wins)."""
        # Imported here: pydantic-settings is not needed to parse the command line or print its help.
        from pydantic import ValidationError

        from switchyard.settings import Settings

        given = {"data_dir": self.data_dir, "database_url": self.database_url, "policy_file": self.policy_file}
        values = {k: v for k, v in {**given, **overrides}.items() if v is not None}
        try:
            return Settings(**values)
        except ValidationError as exc:
            lines = [f"  {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
            raise click.ClickException("invalid settings:\n" + "\n".join(lines)) from None


def cli_context() -> CliContext:
    """The current command's :class:`CliContext`."""
    obj = click.get_current_context().find_object(CliContext)
    return obj if obj is not None else CliContext()


def cli_author(author: str | None) -> str:
    """Who a change from the command line is by: the given author, else ``cli:<OS user>``."""
    if author:
        return author
    try:
        return f"cli:{getpass.getuser()}"
    except (OSError, KeyError):  # no login name and no passwd entry (some containers)
        return f"cli:uid-{os.getuid()}"


def cli_origin() -> str:
    """Where a change from the command line comes from, for the audit log."""
    return f"cli {socket.gethostname()}"
