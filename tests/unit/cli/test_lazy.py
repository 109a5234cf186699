"""The command line's tables of lazily imported commands say what the commands themselves say."""

from __future__ import annotations

import click
import pytest

from switchyard.cli import COMMANDS, admin_cmds, main
from switchyard.cli.lazy import LazyCommand, LazyGroup
from switchyard.cli.policy_cmds import policy
from switchyard.store import admin_users

GROUPS: dict[str, LazyGroup] = {"switchyard": main, "switchyard policy": policy}
ENTRIES = [(label, name, entry) for label, group in GROUPS.items() for name, entry in group.lazy_commands.items()]


def test_every_top_level_command_is_lazy() -> None:
    assert main.lazy_commands == COMMANDS
    assert sorted(COMMANDS) == ["admin", "bench", "db", "demo", "keys", "metrics", "policy", "serve", "sim",
                                "tenants", "usage", "worker"]


@pytest.mark.parametrize(("group", "name", "entry"), ENTRIES, ids=[f"{g} {n}" for g, n, _ in ENTRIES])
def test_the_table_names_the_command_and_its_short_help(group: str, name: str, entry: LazyCommand) -> None:
    command = entry.load()
    assert command.name == name, f"{entry.target} is named {command.name!r}, listed as {name!r} under {group}"
    assert not command.hidden and not command.deprecated
    assert entry.short_help == command.get_short_help_str(limit=10_000), (
        f"the short help of `{group} {name}` in its table is not the first sentence of {entry.target}'s docstring")


@pytest.mark.parametrize("label", list(GROUPS))
@pytest.mark.parametrize("width", [60, 80, 120, 200])
def test_the_listing_is_the_one_click_prints_for_the_loaded_commands(label: str, width: int) -> None:
    group = GROUPS[label]
    eager = click.Group(commands={**group.commands, **{n: e.load() for n, e in group.lazy_commands.items()}})
    ctx = click.Context(group)
    lazy_help, eager_help = click.HelpFormatter(width=width), click.HelpFormatter(width=width)
    group.format_commands(ctx, lazy_help)
    eager.format_commands(click.Context(eager), eager_help)
    assert lazy_help.getvalue() == eager_help.getvalue()
    assert "Commands:" in lazy_help.getvalue()


def test_a_lazy_command_is_imported_once_and_then_found_like_any_other() -> None:
    group = LazyGroup(lazy_commands={"db": COMMANDS["db"]})
    ctx = click.Context(group)
    assert group.commands == {}
    first = group.get_command(ctx, "db")
    assert first is not None and group.commands == {"db": first}
    assert group.get_command(ctx, "db") is first
    assert group.get_command(ctx, "nothing") is None


def test_a_target_that_is_not_a_command_is_refused() -> None:
    with pytest.raises(TypeError, match="is not a click command"):
        LazyCommand("switchyard.cli.admin_cmds:ROLES", "roles").load()


def test_the_admin_commands_roles_are_the_stores() -> None:
    assert admin_cmds.ROLES == admin_users.ROLES
