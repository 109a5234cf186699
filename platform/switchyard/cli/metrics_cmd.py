"""``switchyard metrics``: the catalogue of every metric the gateway exports at ``/metrics``."""

from __future__ import annotations

import click


@click.command("metrics")
@click.option("--format", "fmt", type=click.Choice(["markdown", "json"]), default="markdown", show_default=True,
              help="A Markdown table (as in the README) or JSON.")
def metrics(fmt: str) -> None:
    """Print every metric the gateway exports: name as scraped, type, labels, meaning, label values.

    Read off the gateway's own registry, so it always matches the code. Exits 1 if a label has no
    description of its values.
    """
    from switchyard.gateway.metrics_catalogue import CatalogueError, build_catalogue, render_json, render_markdown

    try:
        catalogue = build_catalogue()
    except CatalogueError as exc:
        raise click.ClickException("the metrics catalogue is incomplete:\n" + "\n".join(exc.issues)) from None
    click.echo(render_json(catalogue) if fmt == "json" else render_markdown(catalogue), nl=False)
