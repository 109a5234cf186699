"""Subcommands imported when they run, not when the command line starts.

``switchyard --help`` must answer at once, so the ``switchyard`` group does not import what its
commands need (the gateway, the store, the bench). :class:`LazyGroup` is click's documented way of
loading subcommands on demand: ``get_command`` imports a command's module the first time the command is
asked for, and the help listing shows the short help kept next to the command's import path, so listing
the commands imports none of them. ``tests/unit/cli/test_lazy.py`` checks that table against the real
commands, so the two cannot drift.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click


@dataclass(frozen=True, slots=True)
class LazyCommand:
    """Where a subcommand lives and what the help listing says about it.

    Args:
        target: ``module:attribute`` of the click command, e.g. ``switchyard.cli.run_cmds:serve``.
        short_help: The command's short help: the first sentence of its docstring, as click makes it.
    """

    target: str
    short_help: str

    def load(self) -> click.Command:
        """Import the command's module and return the command.

        Raises:
            TypeError: The target is not a click command.
        """
        module, _, attribute = self.target.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.target} is not a click command")
        return command


class LazyGroup(click.Group):
    """A click group whose ``lazy_commands`` are imported on first use.

    Args:
        lazy_commands: Subcommand name to :class:`LazyCommand`; commands added the usual way
            (``@group.command``, ``add_command``) work alongside them.
        *args: Passed on to :class:`click.Group`.
        **kwargs: Passed on to :class:`click.Group`.
    """

    def __init__(self, *args: Any, lazy_commands: Mapping[str, LazyCommand] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands: dict[str, LazyCommand] = dict(lazy_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every subcommand's name, loaded or not, sorted (as :class:`click.Group` sorts them)."""
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The subcommand ``cmd_name``, importing its module if it is a lazy one."""
        lazy = self.lazy_commands.get(cmd_name)
        if lazy is None or cmd_name in self.commands:
            return super().get_command(ctx, cmd_name)
        command = lazy.load()
        self.add_command(command, cmd_name)  # imported once; later lookups find it like any other
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The "Commands" section, with the lazy commands' short help from their table (nothing imported).

        A lazy command is shown through a stand-in carrying its short help as its help text, so click
        shortens it for the terminal's width exactly as it shortens the real command's docstring.
        """
        shown: list[tuple[str, click.Command]] = []
        for name in self.list_commands(ctx):
            lazy = self.lazy_commands.get(name)
            command = click.Command(name, help=lazy.short_help) if lazy is not None else self.commands.get(name)
            if command is not None and not command.hidden:
                shown.append((name, command))
        if not shown:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in shown)  # click's own spacing
        with formatter.section("Commands"):
            formatter.write_dl([(name, command.get_short_help_str(limit)) for name, command in shown])
