"""``switchyard policy validate|schema``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from switchyard.decide.policy_tests import compile_checked
from switchyard.policy import PolicyDocument, PolicyError, read_policy_file


@click.group()
def policy() -> None:
    """Check and describe policy documents."""


@policy.command()
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def validate(file: Path, as_json: bool) -> None:
    """Validate FILE (schema, references, policy tests); exit 1 with one line per error."""
    try:
        snapshot = compile_checked(read_policy_file(file), str(file))
    except PolicyError as error:
        if as_json:
            click.echo(json.dumps({"valid": False, "errors": [i.as_dict() for i in error.issues]}, indent=2))
        else:
            for issue in error.issues:
                click.echo(str(issue), err=False)
        sys.exit(1)
    doc = snapshot.document
    summary = {"valid": True, "sha256": snapshot.sha256, "regions": len(doc.regions), "pools": len(doc.pools),
               "models": len(doc.models), "routes": len(doc.routes), "tiers": len(doc.tiers),
               "tests_passed": len(doc.tests)}
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        click.echo(f"{file}: valid ({summary['regions']} regions, {summary['pools']} pools, "
                   f"{summary['models']} models, {summary['routes']} routes, {summary['tiers']} tiers; "
                   f"{summary['tests_passed']} policy tests passed)")


@policy.command()
def schema() -> None:
    """Print the policy document's JSON Schema (for editors and CI)."""
    document = PolicyDocument.model_json_schema(by_alias=True)
    document["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    document["title"] = "Switchyard policy document"
    click.echo(json.dumps(document, indent=2))
