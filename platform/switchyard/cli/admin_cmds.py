"""``switchyard admin``: console users (argon2id-hashed passwords, roles viewer / operator / admin)."""

from __future__ import annotations

import sys

import click

from switchyard.cli.context import cli_author, cli_context, cli_origin
from switchyard.cli.database import open_session

#: The console's roles, weakest first: ``switchyard.store.admin_users.ROLES``, repeated here so that parsing the
#: command line does not load the store (``tests/unit/cli/test_lazy.py`` keeps the two equal).
ROLES = ("viewer", "operator", "admin")


def _password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    value: str = click.prompt("Password", hide_input=True, confirmation_prompt=True)
    return value


def _hash_as_configured() -> None:
    """Hash passwords with the settings' profile (``SWITCHYARD_PASSWORD_HASH_PROFILE``)."""
    from switchyard.store.admin_users import use_hash_profile

    use_hash_profile(cli_context().settings().password_hash_profile)


@click.group()
def admin() -> None:
    """Console users: create them, list them, change their role or password, disable them."""


@admin.command("create-user")
@click.argument("username")
@click.option("--role", type=click.Choice(ROLES), default="viewer", show_default=True,
              help="viewer: reads everything; operator: also edits and publishes the policy and purges caches; "
                   "admin: also tenants, keys and their limits.")
@click.option("--password-stdin", is_flag=True, help="Read the password from the first line of stdin (scripts).")
@click.option("--author", default=None, help="Who is acting, for the audit log [default: $USER].")
def create_user_cmd(username: str, role: str, password_stdin: bool, author: str | None) -> None:
    """Add a console user. The password is asked twice (or read from stdin) and stored only as a hash."""
    from switchyard.store.admin_users import create_user

    _hash_as_configured()
    password = _password(password_stdin)
    with open_session() as session:
        user = create_user(session, username, password, role, actor=cli_author(author), origin=cli_origin())
    click.echo(f"console user {user.username} ({user.role}) created")


@admin.command("users")
def users_cmd() -> None:
    """List console users."""
    from switchyard.store.admin_users import list_users

    with open_session() as session:
        rows = list_users(session)
    for u in rows:
        state = f"disabled {u.disabled_at:%Y-%m-%d}" if u.disabled_at else "active"
        via = f"  signs in through {u.oidc_issuer}" if u.oidc_issuer else ""
        click.echo(f"{u.username:<24} {u.role:<9} {state:<20} created {u.created_at:%Y-%m-%d %H:%M}{via}")


@admin.command("set-role")
@click.argument("username")
@click.argument("role", type=click.Choice(ROLES))
@click.option("--author", default=None)
def set_role_cmd(username: str, role: str, author: str | None) -> None:
    """Change a user's role (takes effect at their next request)."""
    from switchyard.store.admin_users import set_role

    with open_session() as session:
        user = set_role(session, username, role, actor=cli_author(author), origin=cli_origin())
    click.echo(f"console user {user.username} is now {user.role}")


@admin.command("set-password")
@click.argument("username")
@click.option("--password-stdin", is_flag=True)
@click.option("--author", default=None)
def set_password_cmd(username: str, password_stdin: bool, author: str | None) -> None:
    """Set a new password; the user's sessions end."""
    from switchyard.store.admin_users import set_password

    _hash_as_configured()
    password = _password(password_stdin)
    with open_session() as session:
        set_password(session, username, password, actor=cli_author(author), origin=cli_origin())
    click.echo(f"password of {username} changed; their sessions ended")


@admin.command("disable")
@click.argument("username")
@click.option("--author", default=None)
def disable_cmd(username: str, author: str | None) -> None:
    """Stop a user from logging in; their sessions end at once."""
    from switchyard.store.admin_users import disable_user

    with open_session() as session:
        disable_user(session, username, actor=cli_author(author), origin=cli_origin())
    click.echo(f"console user {username} disabled")
