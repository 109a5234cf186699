"""``switchyard usage``: the usage ledger, per UTC day, tenant, key and model."""

from __future__ import annotations

import json
from datetime import datetime

import click

from switchyard.cli.database import open_session


@click.command("usage")
@click.option("--tenant", default=None, help="Only this tenant.")
@click.option("--model", default=None, help="Only this model.")
@click.option("--since", type=click.DateTime(["%Y-%m-%d"]), default=None, help="First UTC day (YYYY-MM-DD).")
@click.option("--until", type=click.DateTime(["%Y-%m-%d"]), default=None, help="Last UTC day (YYYY-MM-DD).")
@click.option("--json", "as_json", is_flag=True)
def usage_cmd(tenant: str | None, model: str | None, since: datetime | None, until: datetime | None,
              as_json: bool) -> None:
    """The usage ledger: requests, tokens and spend per UTC day, tenant, key and model."""
    from switchyard.store.usage import usage

    with open_session() as session:
        report = usage(session, tenant=tenant, model=model, since=since.date() if since else None,
                       until=until.date() if until else None)
    if as_json:
        click.echo(json.dumps(report.model_dump(mode="json"), indent=2))
        return
    click.echo(f"{'day':<10}  {'tenant':<20} {'key':>5}  {'model':<16} {'requests':>9} {'prompt':>10} "
               f"{'completion':>10} {'cached':>9} {'spend':>10}")
    for r in report.rows:
        click.echo(f"{r.day:%Y-%m-%d}  {r.tenant:<20} {r.key_id:>5}  {r.model:<16} {r.requests:>9} "
                   f"{r.prompt_tokens:>10} {r.completion_tokens:>10} {r.cached_tokens:>9} {r.spend:>10.4f}")
    t = report.totals
    click.echo(f"{'total':<10}  {'':<20} {'':>5}  {'':<16} {t.requests:>9} {t.prompt_tokens:>10} "
               f"{t.completion_tokens:>10} {t.cached_tokens:>9} {t.spend:>10.4f}")
