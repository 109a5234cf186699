"""``switchyard policy``: validate, describe, publish, roll back, compare and export the policy (``replay``
lives in ``replay_cmd``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from switchyard.cli.context import cli_author, cli_context, cli_origin
from switchyard.cli.database import open_session
from switchyard.cli.lazy import LazyCommand, LazyGroup
from switchyard.store.errors import NotFound

if TYPE_CHECKING:
    from sqlmodel import Session

    from switchyard.policy import PolicyError

_VERSION = re.compile(r"^v?(\d+)$")

#: Subcommands that live in modules of their own (``tests/unit/cli/test_lazy.py`` keeps the short help true).
LAZY_COMMANDS = {
    "canary": LazyCommand("switchyard.cli.canary_cmds:canary",
                          "Roll a policy version out to a slice of traffic, with steps and guardrails: start, "
                          "status, promote, abort."),
    "replay": LazyCommand("switchyard.cli.replay_cmd:replay",
                          "Replay a trace against the active policy (or --against) and CANDIDATE, in simulated "
                          "time, and report what would change: placement, cost per 1,000 requests, refusals per "
                          "tier, TTFT per class and the prefix-cache hit ratio."),
}


@click.group(cls=LazyGroup, lazy_commands=LAZY_COMMANDS)
def policy() -> None:
    """Check, describe, publish, roll back, compare and export policy documents."""


def _rejected(error: PolicyError) -> NoReturn:
    """Print one line per issue (YAML path and line) and exit 1."""
    for issue in error.issues:
        click.echo(str(issue))
    sys.exit(1)


@policy.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def validate(file: Path, as_json: bool) -> None:
    """Validate FILE (schema, references, policy tests); exit 1 with one line per error."""
    from switchyard.decide.policy_tests import compile_checked, policy_warnings
    from switchyard.policy import PolicyError, read_policy_file

    try:
        snapshot = compile_checked(read_policy_file(file), str(file))
    except PolicyError as error:
        if as_json:
            click.echo(json.dumps({"valid": False, "errors": [i.as_dict() for i in error.issues]}, indent=2))
            sys.exit(1)
        _rejected(error)
    doc = snapshot.document
    summary = {"valid": True, "sha256": snapshot.sha256, "regions": len(doc.regions), "pools": len(doc.pools),
               "models": len(doc.models), "routes": len(doc.routes), "tiers": len(doc.tiers),
               "tests_passed": len(doc.tests)}
    warnings = policy_warnings(snapshot, str(file))
    if as_json:
        click.echo(json.dumps({**summary, "warnings": [w.as_dict() for w in warnings]}, indent=2))
    else:
        click.echo(f"{file}: valid ({summary['regions']} regions, {summary['pools']} pools, "
                   f"{summary['models']} models, {summary['routes']} routes, {summary['tiers']} tiers; "
                   f"{summary['tests_passed']} policy tests passed)")
        for warning in warnings:
            click.echo(f"warning: {warning}")


@policy.command("test")
@click.argument("file", metavar="FILE|VERSION")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def test_cmd(file: str, as_json: bool) -> None:
    """Run FILE's policy tests through the gateway's decisions; exit 1 if one fails.

    Each test's request goes through the same code the gateway runs (model resolution, fallback
    plan, endpoint picking on an idle fleet); nothing is sent anywhere. Instead of a file, name a
    stored version (7 or v7, or `active`): its tests run against it, as it was published.
    """
    from switchyard.decide.policy_tests import run_policy_tests
    from switchyard.policy import PolicyError, compile_policy, read_policy_file

    stored = _is_stored(file)
    try:
        if stored:
            with open_session() as session:
                label, text = _read_stored(session, file)
            snapshot = compile_policy(text, f"policy version {label.removeprefix('v')}", int(label[1:]))
        else:
            label, snapshot = file, compile_policy(read_policy_file(file), file)
    except PolicyError as error:
        _rejected(error)
    results = run_policy_tests(snapshot)
    failed = [r for r in results if not r.passed]
    if as_json:
        click.echo(json.dumps({"policy": label, "passed": len(results) - len(failed), "failed": len(failed),
                               "tests": [{"name": r.name, "passed": r.passed, "expected": r.expected, "got": r.got}
                                         for r in results]}, indent=2))
    else:
        if stored:
            click.echo(f"policy tests of {label}")
        for r in results:
            click.echo(f"{'PASS' if r.passed else 'FAIL'} {r.name}: expected {r.expected}"
                       + ("" if r.passed else f"; got {r.got}"))
        click.echo(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if failed:
        sys.exit(1)


@policy.command()
def schema() -> None:
    """Print the policy document's JSON Schema (for editors and CI)."""
    from switchyard.policy import PolicyDocument

    document = PolicyDocument.model_json_schema(by_alias=True)
    document["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    document["title"] = "Switchyard policy document"
    click.echo(json.dumps(document, indent=2))


# --- versions ----------------------------------------------------------------------------------

def _refuse_in_file_mode(what: str) -> None:
    settings = cli_context().settings()
    if settings.policy_source == "file":
        raise click.ClickException(
            f"{what} is refused: policy_source is file, so {settings.policy_file} is the truth. Change that file "
            "(every gateway imports it as a new version), or set SWITCHYARD_POLICY_SOURCE=db to manage the "
            "policy in the database.")


@policy.command("publish")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--message", "-m", default="", help="Why (kept with the version and in the audit log).")
@click.option("--author", default=None, help="Who publishes [default: cli:<OS user>].")
def publish_cmd(file: Path, message: str, author: str | None) -> None:
    """Validate FILE and make it the active version (policy_source=db only).

    Invalid documents (schema, references, failing policy tests) are refused with one line per
    error and exit 1; nothing is written.
    """
    from switchyard.policy import PolicyError, read_policy_file
    from switchyard.store.policy_versions import publish

    _refuse_in_file_mode("publishing")
    try:
        text = read_policy_file(file)
        with open_session() as session:
            version, created = publish(session, text, source="cli", author=cli_author(author), message=message,
                                       origin=cli_origin(), document=str(file))
    except PolicyError as error:
        _rejected(error)
    if created:
        parent = f"v{version.parent}" if version.parent is not None else "none"
        click.echo(f"published v{version.number} (parent {parent}, sha256 {version.sha256[:12]})")
    else:
        click.echo(f"no change: {file} is the active version v{version.number} already")


@policy.command("rollback")
@click.argument("number", type=int)
@click.option("--message", "-m", default=None, help="Why [default: rollback to vN].")
@click.option("--author", default=None, help="Who rolls back [default: cli:<OS user>].")
def rollback_cmd(number: int, message: str | None, author: str | None) -> None:
    """Make version NUMBER's content active again, as a new version (policy_source=db only)."""
    from switchyard.policy import PolicyError
    from switchyard.store.policy_versions import rollback

    _refuse_in_file_mode("rolling back")
    try:
        with open_session() as session:
            version, created = rollback(session, number, author=cli_author(author), message=message,
                                        origin=cli_origin())
    except PolicyError as error:
        click.echo(f"v{number} no longer passes validation; nothing was written:", err=True)
        _rejected(error)
    if created:
        click.echo(f"rolled back: v{version.number} is active, with the content of v{number}")
    else:
        click.echo(f"no change: the content of v{number} is already active (v{version.number})")


@policy.command("history")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1), help="How many versions.")
@click.option("--json", "as_json", is_flag=True, help="Print the versions as JSON.")
def history(limit: int, as_json: bool) -> None:
    """List policy versions, newest first (* marks the active one)."""
    from switchyard.store.policy_versions import list_versions

    with open_session() as session:
        rows = list_versions(session, limit)
    if as_json:
        click.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return
    for r in rows:
        parent = f"v{r.parent}" if r.parent is not None else "-"
        click.echo(f"{'*' if r.active else ' '} v{r.number:<5} {r.created_at:%Y-%m-%d %H:%M:%S}  {r.source:<8} "
                   f"parent {parent:<6} {r.author:<24} {r.message}".rstrip())


def _version_number(ref: str) -> int | None:
    """The version ``7`` or ``v7`` names, unless a file of that name exists."""
    match = _VERSION.fullmatch(ref)
    return int(match[1]) if match is not None and not Path(ref).exists() else None


def _is_stored(ref: str) -> bool:
    """Whether ``ref`` names a stored version (``active``, ``7``, ``v7``) rather than a file."""
    return ref == "active" or _version_number(ref) is not None


def _read_stored(session: Session, ref: str) -> tuple[str, str]:
    """The label and text of a stored version, or of the file ``ref`` names."""
    from switchyard.policy import read_policy_file
    from switchyard.store.policy_versions import active_version, get_version

    number = _version_number(ref)
    if ref == "active":
        row = active_version(session)
        if row is None:
            raise NotFound("no policy version has been recorded yet")
    elif number is not None:
        row = get_version(session, number)
    else:
        return ref, read_policy_file(ref)
    return f"v{row.number}", row.yaml_text


def _read_pair(old: str, new: str) -> tuple[tuple[str, str], tuple[str, str]]:
    from switchyard.policy import read_policy_file

    if not (_is_stored(old) or _is_stored(new)):
        return (old, read_policy_file(old)), (new, read_policy_file(new))
    with open_session() as session:
        return _read_stored(session, old), _read_stored(session, new)


@policy.command("diff")
@click.argument("old")
@click.argument("new")
@click.option("--json", "as_json", is_flag=True, help="Print the changes and the unified diff as JSON.")
def diff_cmd(old: str, new: str, as_json: bool) -> None:
    """Show what changes from OLD to NEW: semantic changes, then the unified diff of the text.

    OLD and NEW are each a version number (7 or v7), `active`, or a policy file: `switchyard
    policy diff active candidate.yaml` shows what publishing the candidate would change.
    """
    from switchyard.policy import PolicyError
    from switchyard.policy.diff import diff_documents

    try:
        (old_label, old_text), (new_label, new_text) = _read_pair(old, new)
        result = diff_documents(old_text, new_text, old_label, new_label)
    except PolicyError as error:
        _rejected(error)
    if as_json:
        click.echo(json.dumps({"from": old_label, "to": new_label, **result.as_dict()}, indent=2))
        return
    for line in result.lines():
        click.echo(line)
    if result.unified:
        click.echo()
        click.echo(result.unified)


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path``'s content in one step (a reader never sees half a policy).

    A symbolic link is followed: the file it points to is replaced, the link stays.
    """
    path = path.resolve()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise click.ClickException(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        if path.exists():
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@policy.command("export")
@click.option("--version", "number", type=int, default=None, help="This version [default: the active one].")
@click.option("--output", "-o", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write to FILE [default: standard output]; an existing FILE is updated as with --onto.")
@click.option("--onto", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="Update this existing file in place, keeping its comments and key order where the "
                   "content did not change.")
def export(number: int | None, output: Path | None, onto: Path | None) -> None:
    """Write a stored version's YAML (the text as it was published, comments included)."""
    from switchyard.policy import PolicyError, read_policy_file
    from switchyard.policy.export import merge_onto
    from switchyard.store.policy_versions import active_version, get_version

    if output is not None and onto is not None and output != onto:
        raise click.UsageError("give either --output or --onto, not both")
    with open_session() as session:
        if number is None:
            row = active_version(session)
            if row is None:
                raise click.ClickException("no policy version has been recorded yet")
        else:
            row = get_version(session, number)
        label, text = f"v{row.number}", row.yaml_text
    target = onto or output
    if target is None:
        click.echo(text, nl=False)
        return
    if not target.exists():
        _write_atomically(target, text)
        click.echo(f"wrote {label} to {target}", err=True)
        return
    try:
        existing = read_policy_file(target)
        merged = merge_onto(existing, text, str(target))
    except PolicyError as error:
        click.echo(f"cannot update {target} in place:", err=True)
        _rejected(error)
    if merged.text == existing:
        click.echo(f"{target} already holds {label}: unchanged", err=True)
        return
    _write_atomically(target, merged.text)
    kept = "comments and key order kept" if merged.kept_layout else "its layout could not be kept: rewritten whole"
    click.echo(f"updated {target} to {label} ({kept})", err=True)


@policy.command("audit")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1), help="How many entries.")
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def audit(limit: int, as_json: bool) -> None:
    """List the audit log, newest first: who changed what, when and from where."""
    from switchyard.store.audit import list_events

    with open_session() as session:
        rows = list_events(session, limit)
    if as_json:
        click.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return
    for r in rows:
        detail = json.dumps(r.detail, separators=(",", ":"), default=str)
        click.echo(f"{r.at:%Y-%m-%d %H:%M:%S}  {r.action:<16} {r.target:<10} {r.actor:<24} {r.origin:<24} {detail}")
